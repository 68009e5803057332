"""User-facing configuration and mode switches, checked against their docstrings:
deterministic mode (:func:`fusegnn.sparse.dispatch.deterministic`,
``torch.use_deterministic_algorithms``), the kernels' ``tuning`` context managers and the
environment variables fusegnn reads (``ENVIRONMENT.md``).

Without CUDA the fused kernels run through Triton's interpreter (set before Triton is
imported); inputs are tiny.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.sparse import Graph, dispatch, reference, spmm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _small_graph() -> Graph:
    ei = torch.tensor([[0, 1, 2, 3, 1, 2], [1, 2, 3, 0, 0, 0]], device=DEVICE)
    return Graph(ei, 4)


@pytest.fixture
def restore_torch_determinism():
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# ----------------------------------------------------------------------------- deterministic mode
def test_gas_refused_in_strict_mode_after_a_warn_only_call(restore_torch_determinism):
    # dispatch docstring: explicit "gas" raises in deterministic mode, and only warns under
    # torch's warn_only (fusegnn's own flag unset). A warn_only call must not leave a
    # remembered path behind that a later strict call would take without the check.
    graph = _small_graph()
    x = torch.randn(4, 3, device=DEVICE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for _ in range(2):  # every call warns (decisions that warn are not remembered)
        with pytest.warns(UserWarning, match="not deterministic"):
            out = spmm(graph, x, aggregation="gas")
        torch.testing.assert_close(out, reference.spmm(graph, x))
    with dispatch.deterministic(), pytest.raises(RuntimeError, match="not deterministic"):
        spmm(graph, x, aggregation="gas")
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="not deterministic"):
        spmm(graph, x, aggregation="gas")


# ----------------------------------------------------------------------------- spmm tuning
from fusegnn.kernels import spmm as fused_spmm  # noqa: E402
from fusegnn.kernels.spmm_gar import GarConfig  # noqa: E402
from fusegnn.kernels.spmm_gas import GasConfig  # noqa: E402


@pytest.mark.parametrize(
    "override, error, match",
    [
        (dict(gas=GasConfig(block_e=-4, block_f=16)), ValueError, r"gas=\.\.\.\)\.block_e must be a positive int"),
        (dict(gas=GasConfig(block_e=24, block_f=16)), ValueError, r"block_e must be a power of two, got 24"),
        (dict(gas=GasConfig(block_e=16, block_f=16, num_warps=3)), ValueError, "num_warps must be a power of two"),
        (dict(gas="fast"), TypeError, r"tuning\(gas=\.\.\.\) must be a GasConfig"),
        (dict(gar=GasConfig(16, 16)), TypeError, r"tuning\(gar=\.\.\.\) must be a GarConfig"),
        (dict(gar=GarConfig(block_e=16, block_f=12)), ValueError, r"block_f must be a power of two, got 12"),
        (dict(gar=GarConfig(block_e=16, block_f=16, num_stages=0)), ValueError, "num_stages must be a positive int"),
        (dict(gar=GarConfig(block_e=16, block_f=16, seg_len=0)), ValueError, "seg_len must be a positive int"),
    ],
    ids=["gas-negative", "gas-not-pow2", "gas-warps", "gas-str", "gar-wrong-kind", "gar-block-f", "gar-stages",
         "gar-seg-len"],
)
def test_spmm_tuning_refuses_bad_configs_when_set(override, error, match):
    # a negative block_e used to run an empty grid (an all-zero result), others failed
    # inside Triton at the first launch
    before = fused_spmm._gas_override, fused_spmm._gar_override
    with pytest.raises(error, match=match):
        with fused_spmm.tuning(**override):
            pass
    assert (fused_spmm._gas_override, fused_spmm._gar_override) == before


def test_spmm_tuning_checks_a_callables_result_at_launch():
    graph = _small_graph()
    x = torch.randn(4, 3, device=DEVICE)
    with fused_spmm.tuning(gas=lambda feat, elem_size, dot: GasConfig(block_e=0, block_f=16)):
        with pytest.raises(ValueError, match=r"tuning\(gas=\.\.\.\)'s result\.block_e must be a positive int"):
            spmm(graph, x, aggregation="gas")


def test_spmm_tuning_nests_and_restores_on_exception():
    outer_gar = GarConfig(block_e=8, block_f=4, seg_len=3)
    inner_gas = GasConfig(block_e=16, block_f=4)
    before = fused_spmm._gas_override, fused_spmm._gar_override
    with fused_spmm.tuning(gar=outer_gar):
        with pytest.raises(KeyError):
            with fused_spmm.tuning(gas=inner_gas):
                # an override left None keeps the outer block's
                assert fused_spmm.gar_cfg(4, 8, False, 3.0) == outer_gar
                assert fused_spmm._gas_cfg(4, 8, False, False) == inner_gas
                raise KeyError("inside")
        assert fused_spmm.gar_cfg(4, 8, False, 3.0) == outer_gar
        assert fused_spmm._gas_override is before[0]
    assert (fused_spmm._gas_override, fused_spmm._gar_override) == before


def test_spmm_tuning_results_match_the_reference():
    graph = _small_graph()
    x = torch.randn(4, 5, dtype=torch.float64, device=DEVICE)
    with fused_spmm.tuning(gas=GasConfig(block_e=2, block_f=2), gar=GarConfig(block_e=2, block_f=2, seg_len=1)):
        for path in ("gas", "gar"):
            torch.testing.assert_close(spmm(graph, x, aggregation=path), reference.spmm(graph, x))


# ----------------------------------------------------------------------------- environment switches
from fusegnn.kernels import _launch  # noqa: E402
from fusegnn.kernels import block_attention  # noqa: E402

_SWITCHES = [("FUSEGNN_FAST_LAUNCH", _launch.fast_launch_enabled),
             ("FUSEGNN_BAND_PATTERNS", block_attention._bands_enabled)]


@pytest.mark.parametrize("name, read", _SWITCHES, ids=[n for n, _ in _SWITCHES])
@pytest.mark.parametrize(
    "value, expected",
    [("0", False), ("false", False), (" OFF ", False), ("no", False), ("1", True), ("True", True),
     ("yes", True), ("", True), (None, True)],
)
def test_env_switches_read_common_spellings(monkeypatch, name, read, value, expected):
    # ENVIRONMENT.md: both default to on, 0 switches them off; "false" used to read as on
    monkeypatch.setattr(_launch, "_STATE", {"broken": False})
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read() is expected


@pytest.mark.parametrize("name, read", _SWITCHES, ids=[n for n, _ in _SWITCHES])
def test_env_switches_refuse_garbage_naming_the_variable(monkeypatch, name, read):
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=f"{name}='fast' is not an on / off switch"):
        read()


# ----------------------------------------------------------------------------- deterministic switches
@pytest.mark.parametrize("bad", ["false", "0", None, b"1"])
def test_deterministic_switches_refuse_strings_and_none(bad):
    # bool("false") is True: set_deterministic("false") used to switch the mode on
    with pytest.raises(TypeError, match="enabled must be a bool"):
        dispatch.set_deterministic(bad)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with dispatch.deterministic(bad):
            pass
    assert not dispatch.is_deterministic()


def test_deterministic_context_nests_restores_on_exception_and_is_per_thread():
    import threading

    assert not dispatch.is_deterministic()
    with pytest.raises(KeyError):
        with dispatch.deterministic():
            assert dispatch.is_deterministic()
            with dispatch.deterministic(False):
                assert not dispatch.is_deterministic()
            assert dispatch.is_deterministic()
            seen = []
            worker = threading.Thread(target=lambda: seen.append(dispatch.is_deterministic()))
            worker.start()
            worker.join()
            assert seen == [False]  # "in this thread"
            raise KeyError("inside")
    assert not dispatch.is_deterministic()
    try:
        dispatch.set_deterministic(True)
        assert dispatch.is_deterministic()
        with dispatch.deterministic(False):  # the block's own setting wins over the global one
            assert not dispatch.is_deterministic()
        assert dispatch.is_deterministic()
    finally:
        dispatch.set_deterministic(False)
    assert not dispatch.is_deterministic()


def test_deterministic_mode_gives_bitwise_equal_results_and_gradients():
    graph = _small_graph()
    x0 = torch.randn(4, 2, 5, device=DEVICE)
    w0 = torch.rand(graph.num_edges, 2, device=DEVICE)
    path = "auto" if DEVICE == "cuda" else "gar"  # auto takes the reference on the CPU

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = spmm(graph, x, w, aggregation=path)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad, w.grad, dispatch.last_backend()

    with dispatch.deterministic():
        first, second = run(), run()
    assert first[3] == second[3] == "gar"
    for a, b in zip(first[:3], second[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(first[0], reference.spmm(graph, x0, w0))


@pytest.mark.parametrize("bad", [["gar"], {"gar"}, None, 3])
def test_aggregation_of_a_wrong_type_names_the_argument(bad):
    # a list used to fail with "unhashable type: 'list'" from the dispatch cache
    from fusegnn.sparse import edge_softmax, sddmm

    graph = _small_graph()
    x = torch.randn(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        spmm(graph, x, aggregation=bad)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        sddmm(graph, x, x, aggregation=bad)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        edge_softmax(graph, torch.randn(graph.num_edges, device=DEVICE), aggregation=bad)


def test_for_capture_nests_restores_and_refuses_strings():
    assert not dispatch.capture_mode()
    with pytest.raises(KeyError):
        with dispatch.for_capture():
            with dispatch.for_capture(False):
                assert not dispatch.capture_mode()
            assert dispatch.capture_mode()
            raise KeyError("inside")
    assert not dispatch.capture_mode()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with dispatch.for_capture("false"):
            pass
    assert not dispatch.capture_mode()
