"""The examples as a demanding newcomer walks them: every flag a bad value of which the
script accepted (and then crashed on with a traceback, or silently ignored) is refused at
parse time with a message naming the flag, and what the scripts print matches what they
compute. Fast: parsing only, or a few epochs on a tiny synthetic graph."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"fusegnn_example_{name}_semantics", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(capsys, parse, argv: list[str]) -> str:
    """stderr of ``parse(argv)``, which must be a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# (argv, the text the message must hold): each crashed with a traceback (statistics on no
# epochs, torch.optim's own ValueError, a loader's check after the data was loaded) or
# trained something other than what was asked (zero hidden width, patience 0 stopping
# after one epoch)
TRAIN_BAD = [
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--epochs", "-3"], "--epochs must be >= 1, got -3"),
    (["--runs", "0"], "--runs must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--hidden", "0"], "--hidden must be >= 1, got 0"),
    (["--model", "gin", "--hidden", "-1"], "--hidden must be >= 1, got -1"),
    (["--model", "gat", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["--model", "gat", "--out-heads", "0"], "--out-heads must be >= 1, got 0"),
    (["--model", "sgc", "--K", "-1"], "--K must be >= 0, got -1"),
    (["--model", "appnp", "--alpha", "2"], "--alpha must be in [0, 1], got 2.0"),
    (["--patience", "0"], "--patience must be >= 1, got 0"),
    (["--sampled", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--sampled", "--num-neighbors", "-2"], "--num-neighbors takes counts >= 0 (or -1: all), got [-2]"),
    (["--device", "foo"], "--device 'foo' is not a device"),
]


@pytest.mark.parametrize("argv, message", TRAIN_BAD, ids=[" ".join(a) for a, _ in TRAIN_BAD])
def test_train_refuses_bad_values_naming_the_flag(capsys, argv, message):
    train = _load_example("train")
    err = _refused(capsys, train.parse_args, argv)
    assert err.startswith("usage:") and f"error: {message}" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_train_refuses_a_cuda_device_that_is_not_there(capsys):
    """--device cuda on a machine without one crashed inside torch (an AssertionError
    'Torch not compiled with CUDA enabled') after loading the data: now one message
    naming the flag, exit status 2, before any data is read."""
    train = _load_example("train")
    err = _refused(capsys, train.main, ["--device", "cuda", "--no-cuda-graph", "--dataset", "NoSuchGraph"])
    assert err.startswith("train.py: error: --device 'cuda': no CUDA device here"), err


def test_train_accepts_the_edges_of_each_range():
    train = _load_example("train")
    args = train.parse_args(["--epochs", "1", "--runs", "1", "--dropout", "0", "--weight-decay", "0",
                             "--model", "appnp", "--K", "0", "--alpha", "1", "--patience", "1", "--device", "cpu"])
    assert (args.epochs, args.runs, args.dropout, args.K, args.alpha, args.patience) == (1, 1, 0.0, 0, 1.0, 1)
    assert train.parse_args(["--sampled", "--num-neighbors=-1,0", "--batch-size", "1"]).num_neighbors == [-1, 0]


def test_distributed_example_shares_the_checks_and_refuses_a_missing_cuda_device(capsys):
    """train_distributed.py parses with train.py's parser (so its checks hold there too);
    a CUDA device that is not there crashed in torch.cuda.set_device."""
    example = _load_example("train_distributed")
    assert "--epochs must be >= 1, got 0" in _refused(capsys, example.parse_args, ["--epochs", "0"])
    if not torch.cuda.is_available():
        err = _refused(capsys, example.main, ["--device", "cuda", "--dataset", "NoSuchGraph"])
        assert err.startswith("train_distributed.py: error: --device 'cuda': no CUDA device here"), err


def test_distributed_example_applies_reorder(monkeypatch):
    """train_distributed.py listed train.py's --reorder in its help and accepted it, but
    trained on the nodes in their original order: the flag is applied (before the
    partition) and the summary says which order ran."""
    from fusegnn.datasets import NodeDataset

    example = _load_example("train_distributed")
    _tiny(monkeypatch, example)
    asked = []
    reorder = NodeDataset.reorder
    monkeypatch.setattr(NodeDataset, "reorder", lambda self, method="rcm", **kw: asked.append(method)
                        or reorder(self, method, **kw))
    summary = example.main(["--device", "cpu", "--reorder", "degree", "--epochs", "1", "--runs", "1", "--quiet"])
    assert asked == ["degree"] and summary["reorder"] == "degree"


def _tiny(monkeypatch, example):
    from fusegnn.datasets.synthetic import generate_reddit_like

    tiny = generate_reddit_like(0.002, seed=0, avg_degree=4)
    monkeypatch.setattr(example, "load_dataset", lambda *args, **kwargs: tiny)
    return tiny


def test_sampled_run_says_its_time_is_per_epoch(capsys, monkeypatch):
    """With --sampled a timed 'step' is a whole epoch of mini-batches (every batch's
    forward, backward and Adam step), which the summary line called 'ms per training step'."""
    train = _load_example("train")
    tiny = _tiny(monkeypatch, train)
    batches = -(-int(tiny.train_mask.sum()) // 16)
    assert batches > 1
    summary = train.main(["--device", "cpu", "--sampled", "--num-neighbors", "3,2", "--batch-size", "16",
                          "--runs", "1", "--epochs", "2", "--quiet", "--model", "sage", "--hidden", "8"])
    out = capsys.readouterr().out
    assert f"{summary['epoch_ms_median']:.2f} ms per training epoch ({batches} mini-batch steps)" in out, out
    assert "per training step" not in out
    train.main(["--device", "cpu", "--runs", "1", "--epochs", "2", "--quiet", "--model", "sage", "--hidden", "8"])
    assert "ms per training step" in capsys.readouterr().out  # full-graph: one step an epoch


SAMPLED_BAD = [
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--hidden", "0"], "--hidden must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--dropout", "2"], "--dropout must be in [0, 1), got 2.0"),
    (["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
    (["--num-neighbors", "-3"], "--num-neighbors takes counts >= 0 (or -1: all), got [-3]"),
    (["--device", "foo"], "--device 'foo' is not a device"),
    (["--synthetic", "--dataset", "Cora"], "--synthetic generates Reddit, ogbn-arxiv or ogbn-products, not 'Cora'"),
]


@pytest.mark.parametrize("argv, message", SAMPLED_BAD, ids=[" ".join(a) for a, _ in SAMPLED_BAD])
def test_train_sampled_refuses_bad_values_naming_the_flag(capsys, argv, message):
    """Each crashed with a traceback (statistics on no epochs, the loader's or torch's own
    check after the data set was loaded) or, for --synthetic --dataset Cora, said 'name
    must be one of [...]' without naming a flag."""
    example = _load_example("train_sampled")
    err = _refused(capsys, example.parse_args, argv)
    assert err.startswith("usage:") and f"error: {message}" in err, err


def test_train_sampled_accepts_the_synthetic_names_in_any_case():
    example = _load_example("train_sampled")
    for name in ("Reddit", "reddit", "ogbn-products", "ogbn-arxiv", "products", "arxiv"):
        assert example.parse_args(["--synthetic", "--dataset", name]).dataset == name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_train_sampled_refuses_a_cuda_device_that_is_not_there(capsys):
    example = _load_example("train_sampled")
    err = _refused(capsys, example.main, ["--device", "cuda", "--dataset", "NoSuchGraph"])
    assert err.startswith("train_sampled.py: error: --device 'cuda': no CUDA device here"), err


def test_sparse_transformer_quick_keeps_the_flags_given(capsys):
    """--quick set its tiny configuration over every flag given with it: `--quick --heads 4
    --window 4 --values 6` ran 2 heads, window 8 and 4 values without a word."""
    example = _load_example("sparse_transformer")
    args = example.parse_args(["--quick", "--heads", "4", "--window", "4", "--values", "6", "--batch", "2",
                               "--seq-len", "256", "--steps", "50", "--log-every", "7"])
    assert (args.heads, args.window, args.values, args.batch, args.seq_len, args.steps, args.log_every) == \
        (4, 4, 6, 2, 256, 50, 7)
    quick = example.parse_args(["--quick"])  # what is not given stays tiny
    assert (quick.seq_len, quick.d_model, quick.heads, quick.window, quick.steps) == (128, 32, 2, 8, 30)


ST_BAD = [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--pairs", "0"], "--pairs must be >= 1, got 0"),
    (["--values", "1"], "--values must be >= 2, got 1"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--window", "-1"], "--window must be >= 0, got -1"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--mask", "bigbird", "--random-density", "2"], "--random-density must be in [0, 1], got 2.0"),
    (["--heads", "3"], "--d-model (32) must be a multiple of --heads (3)"),
    (["--device", "foo"], "--device 'foo' is not a device"),
]


@pytest.mark.parametrize("argv, message", ST_BAD, ids=[" ".join(a) for a, _ in ST_BAD])
def test_sparse_transformer_refuses_bad_values_naming_the_flag(capsys, argv, message):
    """Each crashed after building the models (statistics on no steps or no held-out
    batch, a ZeroDivisionError for --log-every 0 or --batch 0, torch's checks) or timed
    the wrong steps (--warmup -1 kept only the last step)."""
    example = _load_example("sparse_transformer")
    err = _refused(capsys, example.parse_args, ["--quick", *argv])
    assert err.startswith("usage:") and f"error: {message}" in err, err


def test_sparse_transformer_plot_needs_matplotlib_before_training(capsys, monkeypatch, tmp_path):
    """--plot without matplotlib failed with an ImportError after the whole run."""
    import importlib.util as util

    example = _load_example("sparse_transformer")
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    err = _refused(capsys, example.parse_args, ["--quick", "--plot", str(tmp_path / "x.png")])
    assert "--plot needs matplotlib" in err


def test_distributed_help_lists_no_flag_it_refuses_or_ignores(capsys, monkeypatch):
    """train_distributed.py --help printed train.py's whole help: --cuda-graph ('default: on
    CUDA devices') and --sampled, which it refuses, and --num-neighbors / --batch-size,
    which only --sampled reads; and train.py's description ('full-graph ... classification'
    of one process)."""
    monkeypatch.setenv("COLUMNS", "1000")
    example = _load_example("train_distributed")
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--cuda-graph", "--no-cuda-graph", "--sampled", "--num-neighbors", "--batch-size"):
        assert f"[{flag}" not in out and f"  {flag}" not in out, flag
    for flag in ("--partition", "--backend", "--epochs", "--model", "--aggregation", "--json"):
        assert flag in out, flag
    assert "across processes" in out


def _resolves(target: str, module) -> bool:
    """Whether a Sphinx cross-reference ``target`` written in ``module``'s source names
    something: a dotted import path, a name of the module (or of a class in it), of its
    package's modules, or a builtin."""
    import builtins
    import dataclasses
    import importlib
    import inspect
    import pkgutil

    parts = target.lstrip("~.").removesuffix("()").split(".")

    def walk(obj, names) -> bool:
        for name in names:
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            if name in fields:
                return True
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True

    for i in range(len(parts), 0, -1):
        try:
            base = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        if walk(base, parts[i:]):
            return True
    package = module.__name__.rpartition(".")[0]
    siblings = [importlib.import_module(f"{package}.{m.name}")
                for m in pkgutil.iter_modules(importlib.import_module(package).__path__)] if package else []
    scopes = [module, builtins, *siblings] + [c for _, c in inspect.getmembers(module, inspect.isclass)]
    return any(walk(scope, parts) for scope in scopes)


#: fusegnn's optional dependencies (pyproject extras): references into them resolve only where installed
_OPTIONAL_PACKAGES = ("ogb", "torch_scatter", "pymetis", "matplotlib", "torch_geometric")


def test_docstring_cross_references_name_what_exists():
    """:func: / :class: / :meth: / :mod: / :attr: references in fusegnn's sources name
    something that exists (fusegnn.attention.library cited ``compiled_sparse_attention``,
    renamed long ago)."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil
    import re

    import fusegnn

    stale = []
    for info in pkgutil.walk_packages(fusegnn.__path__, "fusegnn."):
        module = importlib.import_module(info.name)
        for target in re.findall(r":(?:func|class|meth|mod|attr|exc):`([^`<]+?)`", inspect.getsource(module)):
            root = target.lstrip("~.").split(".")[0]
            if root in _OPTIONAL_PACKAGES and importlib.util.find_spec(root) is None:
                continue  # an optional package not installed here (ogb on the GPU image): nothing to check
            if not _resolves(target, module):
                stale.append(f"{info.name}: {target}")
    assert not stale, stale
