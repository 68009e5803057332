#!/usr/bin/env bash
# GPU checks of fusegnn.losses (run from the repository root on a CUDA machine):
#   bash benchmarks/loss_gpu_check.sh [extra options of the loss suite, e.g. --steps 10 --out DIR]
# 1. tests/test_losses.py on the GPU (no interpreter: the Triton kernels compiled, plus the
#    CUDA-only moderate shapes in float32 and bfloat16);
# 2. the benchmark suite `loss` -> benchmarks/results/loss/<gpu-slug>.{json,md,png}.
# The liger / cce rows need liger-kernel and cut-cross-entropy: pure-Python wheels, installed
# here from .carry/wheels when they were brought along (the GPU machine has no network).
set -euo pipefail
shopt -s nullglob
wheels=(.carry/wheels/liger_kernel-*.whl .carry/wheels/cut_cross_entropy-*.whl)
if ((${#wheels[@]})); then
    python -m pip install --quiet --no-deps --no-index "${wheels[@]}" || echo "wheel install failed: liger / cce rows will be skipped"
fi
python -m pytest -q tests/test_losses.py
python -m benchmarks.run --suite loss "$@"
