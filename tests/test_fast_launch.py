"""fusegnn.kernels._launch: relaunching a compiled Triton kernel without the binder.

The logic is tested on the CPU with a fake kernel and a fake CUDA device (the fast path
only runs on CUDA); the GPU test checks block attention gives the same bits through both
paths."""

from __future__ import annotations

import pytest
import torch

from fusegnn.kernels import _launch as fl


def fake_kernel_fn(X, Y, n, BLOCK: "tl.constexpr", FLAG: "tl.constexpr"):  # noqa: F821, N803
    pass


class FakeCompiled:
    def __init__(self):
        self.function = "fn-handle"
        self.packed_metadata = ("packed",)
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class FakeKernel:
    """``kernel[grid](*args, **meta)`` like a LazyKernel: records the ordinary launches."""

    __name__ = "fake_kernel"
    fn = staticmethod(fake_kernel_fn)

    def __init__(self):
        self.compiled = FakeCompiled()
        self.ordinary = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **meta):
            self.ordinary.append((grid, args, meta, num_warps, num_stages))
            return self.compiled

        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)
    monkeypatch.setattr(fl, "_hooks_installed", lambda: False)
    monkeypatch.delenv("FUSEGNN_FAST_LAUNCH", raising=False)
    fl.clear_cache()
    fl._STATE["broken"] = False
    yield torch.device("cuda", 0)
    fl.clear_cache()
    fl._STATE["broken"] = False


def test_constexpr_names_follow_the_signature():
    assert fl._constexpr_names(fake_kernel_fn) == (("BLOCK", "FLAG"), 5)

    def interleaved(X, BLOCK: "tl.constexpr", n):  # noqa: F821, N803
        pass

    assert fl._constexpr_names(interleaved) is None  # not rebuilt: always the ordinary launch


def test_second_launch_skips_the_binder_and_passes_constexprs_in_order(fake_cuda):
    kernel = FakeKernel()
    meta = dict(BLOCK=64, FLAG=True, maxnreg=128)  # maxnreg is an option, not a parameter
    first = fl.launch(kernel, (7,), ("x", "y", 5), meta, 4, 2, ("key",), fake_cuda)
    assert first is kernel.compiled and len(kernel.ordinary) == 1
    again = fl.launch(kernel, (7, 3), ("x2", "y2", 5), meta, 4, 2, ("key",), fake_cuda)
    assert again is kernel.compiled and len(kernel.ordinary) == 1  # relaunched, not bound
    assert kernel.compiled.calls == [
        (7, 3, 1, 1234, "fn-handle", ("packed",), None, None, None, "x2", "y2", 5, 64, True)
    ]


@pytest.mark.parametrize("change", ["spec", "meta", "warps", "stages"])
def test_any_key_change_is_an_ordinary_launch(fake_cuda, change):
    kernel = FakeKernel()
    base = dict(spec=("key",), meta=dict(BLOCK=64, FLAG=True), warps=4, stages=2)
    fl.launch(kernel, (1,), ("x", "y", 5), base["meta"], base["warps"], base["stages"], base["spec"], fake_cuda)
    other = dict(base)
    other[change] = {"spec": ("other",), "meta": dict(BLOCK=32, FLAG=True), "warps": 8, "stages": 3}[change]
    fl.launch(kernel, (1,), ("x", "y", 5), other["meta"], other["warps"], other["stages"], other["spec"], fake_cuda)
    assert len(kernel.ordinary) == 2 and kernel.compiled.calls == []


def test_no_key_cpu_switch_and_hooks_are_ordinary_launches(fake_cuda, monkeypatch):
    kernel = FakeKernel()
    meta = dict(BLOCK=64, FLAG=True)
    for _ in range(2):
        fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, None, fake_cuda)  # no key
        fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), torch.device("cpu"))  # interpreter
    assert len(kernel.ordinary) == 4
    fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), fake_cuda)  # cached now
    monkeypatch.setattr(fl, "_hooks_installed", lambda: True)
    fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), fake_cuda)
    assert len(kernel.ordinary) == 6 and kernel.compiled.calls == []
    monkeypatch.setattr(fl, "_hooks_installed", lambda: False)
    monkeypatch.setenv("FUSEGNN_FAST_LAUNCH", "0")
    assert not fl.fast_launch_enabled()
    fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), fake_cuda)
    assert len(kernel.ordinary) == 7 and kernel.compiled.calls == []


def test_a_launcher_that_refuses_the_arguments_switches_the_fast_path_off(fake_cuda):
    kernel = FakeKernel()

    def refuse(*args):
        raise TypeError("launcher expected other arguments")

    kernel.compiled.run = refuse
    meta = dict(BLOCK=64, FLAG=True)
    fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), fake_cuda)
    fl.launch(kernel, (1,), ("x", "y", 5), meta, 4, 2, ("k",), fake_cuda)  # refused, then ordinary
    assert len(kernel.ordinary) == 2
    assert not fl.fast_launch_enabled() and not fl._CACHE


def test_a_compiled_kernel_without_the_launcher_is_not_cached(fake_cuda):
    kernel = FakeKernel()
    kernel.compiled = object()  # an older / newer Triton's object
    for _ in range(2):
        fl.launch(kernel, (1,), ("x", "y", 5), dict(BLOCK=64, FLAG=True), 4, 2, ("k",), fake_cuda)
    assert len(kernel.ordinary) == 2 and not fl._CACHE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_attention_is_bitwise_the_same_through_both_paths(monkeypatch):
    from fusegnn.kernels.block_attention import block_sparse_attention
    from fusegnn.attention import masks
    from fusegnn.attention.block_layout import BlockLayout

    L = 300
    mask = masks.sliding_window(L, 40) | masks.global_tokens(L, 3)
    layout = BlockLayout.from_mask(mask, 64, 64, "cuda")
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, L, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = block_sparse_attention(qq, kk, vv, layout)
        out.backward(g)
        return [out, qq.grad, kk.grad, vv.grad]

    fl.clear_cache()
    monkeypatch.setenv("FUSEGNN_FAST_LAUNCH", "0")
    slow = run()
    monkeypatch.setenv("FUSEGNN_FAST_LAUNCH", "1")
    run()  # fills the cache
    assert fl._CACHE and fl.fast_launch_enabled()
    fast = run()
    for a, b in zip(slow, fast):
        assert torch.equal(a, b)


def test_empty_hook_chains_are_not_hooks():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not fl._active(None)
    assert not fl._active(Chain([]))
    assert fl._active(Chain([print]))
    assert fl._active(print)
    assert not fl._hooks_installed()  # a fresh Triton has no launch hook


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_block_attention_on_a_device_that_is_not_the_current_one():
    """Triton launches on the current device: inputs on another GPU must still work."""
    from fusegnn.kernels.block_attention import block_sparse_attention
    from fusegnn.attention import masks
    from fusegnn.attention.block_layout import BlockLayout

    L = 200
    mask = masks.sliding_window(L, 30)
    gen = torch.Generator().manual_seed(1)
    host = [torch.randn(1, 2, L, 32, generator=gen) for _ in range(4)]
    results = []
    for dev in ("cuda:0", "cuda:1"):
        layout = BlockLayout.from_mask(mask, 64, 64, dev)
        q, k, v = (t.to(dev, torch.float16).requires_grad_() for t in host[:3])
        with torch.cuda.device(0):
            out = block_sparse_attention(q, k, v, layout)
            out.backward(host[3].to(dev, torch.float16))
        results.append([t.cpu() for t in (out, q.grad, k.grad, v.grad)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_cache_is_bounded(fake_cuda, monkeypatch):
    monkeypatch.setattr(fl, "_MAX_ENTRIES", 3)
    kernel = FakeKernel()
    for n in range(5):
        fl.launch(kernel, (1,), ("x", "y", n), dict(BLOCK=64, FLAG=True), 4, 2, ("k", n), fake_cuda)
    assert 1 <= len(fl._CACHE) <= 3
