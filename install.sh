#!/usr/bin/env bash
# Install fusegnn from this checkout (editable), with the PyTorch build that fits the machine.
#
#   ./install.sh                 # the package
#   ./install.sh test            # with extras: test, ogb, scatter, bench, metis (comma-separated)
#   ./install.sh test --dry-run  # print the pip commands instead of running them
#
# PyTorch is chosen only when `import torch` fails; an importable torch is always kept.
#   * `nvidia-smi` runs          -> torch from the default index (PyPI: the CUDA build);
#   * otherwise                  -> the CPU build from $FUSEGNN_TORCH_CPU_INDEX
#                                   (default https://download.pytorch.org/whl/cpu), because
#                                   plain PyPI serves the CUDA build and ~17 nvidia-* wheels
#                                   on Linux x86_64;
#   * that index is unreachable  -> the newest "+cpu" torch of the default index (a mirror
#                                   may carry one), else the default torch, with a warning.
# Environment: PYTHON (interpreter to install into, default python3),
# FUSEGNN_TORCH_CPU_INDEX (a mirror of PyTorch's CPU index).
set -euo pipefail

# The torch lower bound of pyproject.toml (tests/test_packaging.py keeps the two equal).
TORCH_MIN=2.5
PYTHON=${PYTHON:-python3}
CPU_INDEX=${FUSEGNN_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

say() { printf 'install.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }

dry_run=0
extras=""
for arg in "$@"; do
    case $arg in
        -h|--help) sed -n '2,17s/^# \{0,1\}//p' "$0"; exit 0 ;;
        --dry-run) dry_run=1 ;;
        -*) die "unknown option '$arg' (see --help)" ;;
        *) [[ -z $extras ]] || die "EXTRAS given twice ('$extras', '$arg'): join them with commas"
           extras=$arg ;;
    esac
done

cd "$(dirname "${BASH_SOURCE[0]}")"

run() {
    printf '+ %s\n' "$*"
    if (( ! dry_run )); then
        "$@" || die "'$*' failed (if pip said 'externally-managed-environment', work in a virtual environment: python3 -m venv .venv && . .venv/bin/activate)"
    fi
}

if [[ -n $extras ]]; then
    # The extras pyproject.toml declares: the keys of [project.optional-dependencies].
    known=$(sed -n '/^\[project\.optional-dependencies\]/,/^\[/s/^\([A-Za-z0-9_-]*\) *= *\[.*/\1/p' pyproject.toml)
    IFS=, read -ra wanted <<< "$extras"
    for extra in "${wanted[@]}"; do
        grep -qx -- "$extra" <<< "$known" || die "EXTRAS: unknown extra '$extra' (known: $(paste -sd, - <<< "$known"))"
    done
fi

command -v "$PYTHON" > /dev/null || die "PYTHON='$PYTHON' is not a command"

# Python: the (major, minor) release of a version string, "2.13.0+cpu" -> (2, 13).
RELEASE_PY='import re, sys
def release(version):
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])
'

# "ok VERSION", "old VERSION", "broken ERROR" or "absent".
torch_state=$("$PYTHON" -c "$RELEASE_PY"'
import importlib.metadata
try:
    import torch
except Exception as error:
    try:
        importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        print("absent")
    else:
        print("broken", repr(error))
else:
    print("ok" if release(torch.__version__) >= release(sys.argv[1]) else "old", torch.__version__)
' "$TORCH_MIN") || die "could not run PYTHON='$PYTHON'"

# The newest "+cpu" torch (>= TORCH_MIN) the default index and find-links offer, or nothing.
newest_cpu_build() {
    "$PYTHON" -m pip index versions torch 2> /dev/null | "$PYTHON" -c "$RELEASE_PY"'
for line in sys.stdin:
    if line.strip().startswith("Available versions:"):
        versions = line.split(":", 1)[1].replace(",", " ").split()  # newest first
        cpu = [v for v in versions if v.endswith("+cpu") and release(v) >= release(sys.argv[1])]
        print(cpu[0] if cpu else "")
' "$TORCH_MIN"
}

cpu_index_reachable() {
    "$PYTHON" -c 'import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip("/") + "/torch/", method="HEAD"), timeout=15)' \
        "$CPU_INDEX" 2> /dev/null
}

case $torch_state in
    ok*) say "keeping the installed torch ${torch_state#ok }" ;;
    old*) die "torch ${torch_state#old } is installed and fusegnn needs torch>=$TORCH_MIN: upgrade it with the build you use (CPU: pip install -U torch --index-url $CPU_INDEX), then run this again" ;;
    broken*) die "torch is installed but 'import torch' fails (${torch_state#broken }): repair or uninstall it, then run this again" ;;
    absent)
        if nvidia-smi > /dev/null 2>&1; then
            say "nvidia-smi works: installing the CUDA build of torch from the default index"
            run "$PYTHON" -m pip install "torch>=$TORCH_MIN"
        elif cpu_index_reachable; then
            say "no usable GPU (nvidia-smi): installing the CPU build of torch from $CPU_INDEX"
            run "$PYTHON" -m pip install "torch>=$TORCH_MIN" --index-url "$CPU_INDEX"
        elif cpu_build=$(newest_cpu_build) && [[ -n $cpu_build ]]; then
            say "no usable GPU (nvidia-smi) and $CPU_INDEX cannot be reached: installing the CPU build torch==$cpu_build from the default index"
            run "$PYTHON" -m pip install "torch==$cpu_build"
        else
            say "warning: no usable GPU (nvidia-smi), $CPU_INDEX cannot be reached and the default index has no +cpu build of torch>=$TORCH_MIN:"
            say "warning: installing torch from the default index; on PyPI (Linux x86_64) that is the CUDA build with ~17 nvidia-* wheels (several GB)"
            run "$PYTHON" -m pip install "torch>=$TORCH_MIN"
        fi ;;
    *) die "could not inspect torch with $PYTHON: '$torch_state'" ;;
esac

run "$PYTHON" -m pip install -e ".${extras:+[$extras]}"
(( dry_run )) || say "done: fusegnn is installed for $("$PYTHON" -c 'import sys; print(sys.executable)')"
