r"""The workloads of suite ``vector`` (:mod:`benchmarks.vector`): per case, the inputs,
the float32 reference and every backend's step.

A backend's step is a :class:`Step`: a ``forward()`` on the backend's own leaf inputs,
the tensors its backward differentiates (``wrt``, gradient names ``grads``) and the
output gradient. A backend offers a list of :class:`Candidate` steps in order of
preference (its gradients in the case's dtype, fewer gradients, forward only, then the
same in float32); the suite takes the first that runs, and says in the row what the
others raised.

Gradient names, each compared with the reference tensor of the same name:

* ``dx`` (``dq``, ``dk``, ``dv``) -- the gradient of a dense input;
* ``dW`` -- the dense weight gradient :math:`G^\top X` (``[out, in]``);
* ``dW@pattern`` -- :math:`G^\top X` at the pruned weight's non-zeros only (zero elsewhere);
* ``dW@bsr16`` -- :math:`G^\top X` on the non-empty 16 x 16 blocks of the weight.
"""

from __future__ import annotations

import importlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.measure import synchronize

__all__ = [
    "AggGraphs", "CHECK_HEADS", "Candidate", "CaseInputs", "Sizes", "Step", "Unavailable",
    "agg_inputs", "linear_inputs", "mask_inputs",
]

#: heads of batch 0 the attention reference covers (attention is independent per head)
CHECK_HEADS = 2
#: block size of the ``bsr`` backend (``to_sparse_bsr``)
BSR_BLOCK = 16


class Unavailable(Exception):
    """A backend that cannot run here at all (the row says ``skipped: <reason>``)."""


@dataclass(frozen=True)
class Sizes:
    """How a case's parameters become shapes: the GPU sizes are the issue's; the CPU
    smoke sizes divide them so that the interpreter runs a case in a moment."""

    dtype: torch.dtype
    tokens: int  # rows of x in the linear cases
    linear_div: int  # in / out features are divided by this
    heads: int
    head_dim: int
    mask_div: int  # L is divided by this
    agg_scale: float | None  # Reddit-like scale (None: the harness's --scale)
    agg_avg_degree: float | None  # None: the harness's --avg-degree (or Reddit's)
    agg_feature_div: int  # F is divided by this


GPU_SIZES = Sizes(torch.bfloat16, 8192, 1, 8, 64, 1, None, None, 1)
CPU_SIZES = Sizes(torch.float32, 16, 256, 2, 16, 64, 0.0004, 6.0, 8)


@dataclass
class Step:
    """One backend's workload on a case (see the module docstring)."""

    forward: Callable[[], Tensor]
    wrt: tuple[Tensor, ...] = ()
    grads: tuple[str, ...] = ()
    grad_out: Tensor | None = None
    convert: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)  # a gradient -> dense
    reference: dict[str, Tensor] = field(default_factory=dict)  # reference tensors of this backend only
    info: dict[str, Any] = field(default_factory=dict)  # recorded in the row
    describe: Callable[[], dict[str, Any]] | None = None  # more row fields, read after the check

    def run_once(self) -> dict[str, Tensor]:
        """``{"out": ..., <gradient name>: ...}``: the forward, and the backward if any."""
        out = self.forward()
        results = {"out": out.detach()}
        if self.wrt:
            grads = torch.autograd.grad(out, self.wrt, self.grad_out)
            for name, grad in zip(self.grads, grads):
                results[name] = self.convert.get(name, lambda t: t)(grad)
        return results


@dataclass(frozen=True)
class Candidate:
    """A way of running a backend: ``label`` (dtype and gradients) and how to build it."""

    label: str
    build: Callable[[], Step]


@dataclass
class CaseInputs:
    """A prepared case: float32 reference tensors, the part of an output they cover
    (``view``), each backend's candidate steps (built on demand: a backend may raise
    :class:`Unavailable`) and facts every row of the case records."""

    reference: dict[str, Tensor]
    candidates: dict[str, Callable[[], list[Candidate]]]
    view: Callable[[Tensor], Tensor] = lambda t: t
    info: dict[str, Any] = field(default_factory=dict)


def _ms_since(start: float, device: torch.device) -> float:
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _leaf(t: Tensor, dtype: torch.dtype | None = None, grad: bool = True) -> Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_(grad)


def _fallback_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The case's dtype, then float32 (cuSPARSE builds without a bfloat16 kernel)."""
    return (dtype,) if dtype == torch.float32 else (dtype, torch.float32)


def _cuda_feature(device: torch.device, module: str, name: str) -> Any:
    """``module.name``, for a backend that runs on CUDA only (:class:`Unavailable` if not
    here, or if the installed torch lacks it)."""
    if device.type != "cuda":
        raise Unavailable(f"{module}.{name} runs on CUDA only here")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise Unavailable(f"{module}.{name} missing ({type(err).__name__}: {err})") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- linear


def _bsr_block_mask(dense: Tensor, block: int) -> Tensor:
    """Boolean ``dense.shape``: the elements of the non-empty ``block x block`` blocks."""
    rows, cols = dense.shape
    nonzero = (dense != 0).reshape(rows // block, block, cols // block, block).any(dim=3).any(dim=1)
    return nonzero.repeat_interleave(block, 0).repeat_interleave(block, 1)


def _torch_sparse_candidates(layout: str, weight: Tensor, x: Tensor, g: Tensor, dw_name: str,
                             extra_reference: dict[str, Tensor]) -> list[Candidate]:
    """``y = (W_sparse @ x^T)^T`` by ``torch.sparse.mm`` with ``W`` as ``layout`` (``"csr"``
    or ``"bsr"``): gradients of ``x`` and of the sparse ``W`` (torch's autograd), then
    ``x`` only, then the forward alone; in the case's dtype, then float32."""
    def to_sparse(w: Tensor) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR / BSR support is in beta"
            return w.to_sparse_csr() if layout == "csr" else w.to_sparse_bsr(BSR_BLOCK)

    def build(dtype: torch.dtype, level: str) -> Callable[[], Step]:
        def make() -> Step:
            start = time.perf_counter()
            w = to_sparse(weight.to(dtype)).requires_grad_(level == "dx+dW")
            build_ms = _ms_since(start, x.device)
            xl = _leaf(x, dtype, level != "forward only")
            wrt, names = {"dx+dW": ((xl, w), ("dx", dw_name)), "dx": ((xl,), ("dx",)),
                          "forward only": ((), ())}[level]
            return Step(lambda: torch.sparse.mm(w, xl.t()).t(), wrt, names, g.to(dtype),
                        convert={dw_name: lambda t: t.to_dense()}, reference=extra_reference,
                        info={"build_ms": build_ms, "dtype": _dtype_name(dtype)})
        return make

    return [Candidate(f"{_dtype_name(dtype)} {level}", build(dtype, level))
            for dtype in _fallback_dtypes(weight.dtype) for level in ("dx+dW", "dx", "forward only")]


def linear_inputs(case, sizes: Sizes, device: torch.device, seed: int) -> CaseInputs:
    """``y = x W^T``, ``x`` ``[tokens, in]``, ``W`` ``[out, in]`` the pruned weight of a
    :class:`~fusegnn.layers.VectorSparseLinear` (``nn.Linear``'s initial weight pruned
    by :meth:`~fusegnn.sparse.VectorSparse.prune`)."""
    from fusegnn.layers.vector_sparse_linear import VectorSparseLinear

    in_f, out_f = case.in_features // sizes.linear_div, case.out_features // sizes.linear_div
    dtype = sizes.dtype
    torch.manual_seed(seed)  # nn.Linear's initialisation inside the layer
    layer = VectorSparseLinear(in_f, out_f, case.sparsity / 100, case.V, bias=False, device=device, dtype=dtype)
    pattern = layer.pattern()
    dense = pattern.to_dense().detach()
    gen = torch.Generator(device=device).manual_seed(seed)
    x = _randn((sizes.tokens, in_f), gen, device, dtype)
    g = _randn((sizes.tokens, out_f), gen, device, dtype)

    x32, g32, w32 = x.float(), g.float(), dense.float()
    dw = g32.t() @ x32
    reference = {"out": x32 @ w32.t(), "dx": g32 @ w32, "dW": dw, "dW@pattern": dw * pattern.mask()}
    block_reference = {"dW@bsr16": dw * _bsr_block_mask(dense, BSR_BLOCK)}

    def fusegnn() -> list[Candidate]:
        def make() -> Step:
            xl = _leaf(x)
            return Step(lambda: layer(xl), (xl, layer.values), ("dx", "dW@pattern"), g,
                        convert={"dW@pattern": lambda t: pattern.with_values(t).to_dense()},
                        info={"dtype": _dtype_name(dtype)})
        return [Candidate(f"{_dtype_name(dtype)} dx+dW", make)]

    def cublas() -> list[Candidate]:
        def make() -> Step:
            xl, wl = _leaf(x), _leaf(dense)
            return Step(lambda: F.linear(xl, wl), (xl, wl), ("dx", "dW"), g, info={"dtype": _dtype_name(dtype)})
        return [Candidate(f"{_dtype_name(dtype)} dx+dW", make)]

    def cusparselt() -> list[Candidate]:
        # the layer's own 2:4 form: its V-sparse weight, columns reordered into exact 2:4
        _cuda_feature(device, "torch.sparse", "to_sparse_semi_structured")
        backend = torch.backends.cusparselt.is_available() if hasattr(torch.backends, "cusparselt") else False

        def make() -> Step:
            start = time.perf_counter()
            form = layer.to_semi_structured()  # the host-side layout search included
            build_ms = _ms_since(start, device)
            return Step(lambda: form(x), info={
                "build_ms": build_ms, "dtype": _dtype_name(dtype), "impl": type(form.weight_2_4).__name__,
                "cusparselt_available": backend, "width": form.width, "widening": form.layout.widening,
                "weight_density": 0.5 * form.layout.widening})

        return [Candidate(f"{_dtype_name(dtype)} 2:4 forward only (inference form)", make)]

    return CaseInputs(
        reference=reference,
        candidates={
            "fusegnn": fusegnn,
            "cublas": cublas,
            "cusparse": lambda: _torch_sparse_candidates("csr", dense, x, g, "dW@pattern", {}),
            "bsr": lambda: _torch_sparse_candidates("bsr", dense, x, g, "dW@bsr16", block_reference),
            "cusparselt": cusparselt,
        },
        info={"shape": f"x [{sizes.tokens}, {in_f}], W [{out_f}, {in_f}]", "density": pattern.density,
              "vectors": pattern.num_vectors},
    )


# ----------------------------------------------------------------------------- masks


def _dense_mask_mod(allowed: Tensor):
    """FlexAttention's ``mask_mod`` reading the boolean ``[L, L]`` matrix (one code
    object for every case, so compiled FlexAttention recompiles for new shapes only)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]
    return mask_mod


def random_mask(L: int, density: float, gen: torch.Generator, device: torch.device) -> Tensor:
    """Boolean ``[L, L]``: each pair allowed with probability ``density``, independently,
    and the diagonal (no query without a key)."""
    allowed = torch.rand((L, L), generator=gen, device=device) < density
    allowed.diagonal().fill_(True)
    return allowed


def mask_inputs(case, sizes: Sizes, device: torch.device, seed: int) -> CaseInputs:
    """Attention of ``q, k, v`` ``[1, H, L, D]`` under a random element mask
    (:func:`random_mask`)."""
    from fusegnn.attention import masks
    from fusegnn.attention.sparse_attention import sparse_attention

    L = case.L // sizes.mask_div
    dtype = sizes.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    allowed = random_mask(L, case.density / 100, gen, device)
    pairs = allowed.nonzero()
    mask = masks.from_graph(torch.stack([pairs[:, 1], pairs[:, 0]]), L)  # edges key -> query
    shape = (1, sizes.heads, L, sizes.head_dim)
    q, k, v, g = (_randn(shape, gen, device, dtype) for _ in range(4))

    sl = [t[:1, :CHECK_HEADS].float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*sl, attn_mask=allowed)
    grads = torch.autograd.grad(out, sl, g[:1, :CHECK_HEADS].float())
    reference = {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    del out, sl, grads

    def attention_step(fn) -> Step:
        ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
        return Step(lambda: fn(ql, kl, vl), (ql, kl, vl), ("dq", "dk", "dv"), g, info={"dtype": _dtype_name(dtype)})

    def sparse(aggregation: str) -> Callable[[], list[Candidate]]:
        def make() -> Step:
            step = attention_step(lambda q_, k_, v_: sparse_attention(q_, k_, v_, mask, aggregation=aggregation))
            if aggregation == "auto":  # the path the rule took (a training step: with a gradient)
                from fusegnn.attention import explain_attention

                step.info["path"] = explain_attention(q, mask, backward=True).label
            return step
        return lambda: [Candidate(f"{_dtype_name(dtype)} dq+dk+dv", make)]

    def flex() -> list[Candidate]:
        create_block_mask = _cuda_feature(device, "torch.nn.attention.flex_attention", "create_block_mask")
        from benchmarks.attention import _compiled_flex

        def make() -> Step:
            start = time.perf_counter()
            block_mask = create_block_mask(_dense_mask_mod(allowed), None, None, L, L, device=device)
            build_ms = _ms_since(start, device)
            fn = _compiled_flex()
            step = attention_step(lambda q_, k_, v_: fn(q_, k_, v_, block_mask=block_mask))
            step.info.update(build_ms=build_ms, block_size="128x128")
            sparsity = getattr(block_mask, "sparsity", None)
            if callable(sparsity):
                step.info["block_density"] = 1.0 - float(sparsity()) / 100.0
            return step

        return [Candidate(f"{_dtype_name(dtype)} dq+dk+dv", make)]

    return CaseInputs(
        reference=reference,
        candidates={"fusegnn": sparse("vector"), "fusegnn-auto": sparse("auto"), "element": sparse("element"),
                    "flex": flex},
        view=lambda t: t[:1, :CHECK_HEADS],
        info={"shape": f"q/k/v [1, {sizes.heads}, {L}, {sizes.head_dim}]",
              "density": pairs.size(0) / float(L * L)},
    )


# ----------------------------------------------------------------------------- aggregation


class AggGraphs:
    """The Reddit-like graph, its RCM reordering and their derived formats, each built
    once per suite run and timed once (``*_ms``): cases of several widths share them."""

    def __init__(self, scale: float, avg_degree: float | None, seed: int, device: torch.device) -> None:
        self.scale, self.avg_degree, self.seed, self.device = scale, avg_degree, seed, device
        self._items: dict[Any, Any] = {}
        self.facts: dict[str, Any] = {}

    def _once(self, key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self._items:
            self._items[key] = compute()
        return self._items[key]

    def graph(self, reorder: str | None):
        """``(graph, reorder_ms)``: the generated graph, or its ``reorder`` ordering."""
        def generate():
            from fusegnn.datasets import generate_reddit_like

            start = time.perf_counter()
            data = generate_reddit_like(self.scale, self.seed, self.device, avg_degree=self.avg_degree)
            graph = data.graph
            self.facts.update(nodes=graph.num_nodes, edges=graph.num_edges, scale=self.scale,
                              avg_degree=self.avg_degree, generated_ms=_ms_since(start, self.device),
                              source="fusegnn.datasets.generate_reddit_like (generated on the device)")
            return graph, None

        def reordered():
            base, _ = self.graph(None)
            start = time.perf_counter()
            graph, _ = base.reorder(reorder)
            return graph, _ms_since(start, self.device)

        return self._once(("graph", reorder), generate if reorder is None else reordered)

    def csr(self, reorder: str | None, dtype: torch.dtype):
        """``((A, A^T) as CSR with int32 indices, build_ms)``."""
        def build():
            from benchmarks.backends import csr_matrices

            graph, _ = self.graph(reorder)
            start = time.perf_counter()
            a, a_t = csr_matrices(graph)
            if dtype != a.dtype:
                a, a_t = a.to(dtype), a_t.to(dtype)
            return (a, a_t), _ms_since(start, self.device)

        return self._once(("csr", reorder, dtype), build)

    def release(self) -> None:
        self._items.clear()


def agg_inputs(case, sizes: Sizes, device: torch.device, seed: int, graphs: AggGraphs) -> CaseInputs:
    """``out = A x`` (``A`` the Reddit-like adjacency, 1 per edge) and ``dx = A^T G``, on
    the generated graph or its reordering (``case.reorder``)."""
    from benchmarks.backends import _CsrSpmm
    from fusegnn.sparse import dispatch, spmm
    from fusegnn.sparse.window_aggregation import WINDOW_ROWS, graph_windows, window_tile_density, window_values

    dtype = sizes.dtype
    graph, reorder_ms = graphs.graph(case.reorder)
    gen = torch.Generator(device=device).manual_seed(seed)
    features = case.features // sizes.agg_feature_div
    x = _randn((graph.num_src_nodes, features), gen, device, dtype)
    g = _randn((graph.num_dst_nodes, features), gen, device, dtype)
    (a32, a32_t), _ = graphs.csr(case.reorder, torch.float32)
    reference = {"out": torch.sparse.mm(a32, x.float()), "dx": torch.sparse.mm(a32_t, g.float())}

    def fusegnn() -> list[Candidate]:
        # what a user runs: spmm(graph, x, aggregation="window"); the row windows of A and
        # of A^T (the backward's) are built here, once, and timed apart from the step
        def make() -> Step:
            start = time.perf_counter()
            for transposed in (False, True):
                graph_windows(graph, WINDOW_ROWS, transposed=transposed)
            for transposed in (False, True):
                window_values(graph, None, dtype, transposed=transposed)
            build_ms = _ms_since(start, device)
            xl = _leaf(x)
            return Step(lambda: spmm(graph, xl, aggregation="window"), (xl,), ("dx",), g,
                        info={"build_ms": build_ms, "dtype": _dtype_name(dtype), "window": WINDOW_ROWS,
                              "tile_density": window_tile_density(graph, WINDOW_ROWS),
                              "tile_density_t": window_tile_density(graph, WINDOW_ROWS, transposed=True)})
        return [Candidate(f"{_dtype_name(dtype)} dx", make)]

    def element() -> list[Candidate]:
        def make() -> Step:
            xl = _leaf(x)
            return Step(lambda: spmm(graph, xl), (xl,), ("dx",), g, info={"dtype": _dtype_name(dtype)},
                        describe=lambda: {"path": dispatch.last_backend()})
        return [Candidate(f"{_dtype_name(dtype)} dx", make)]

    def cusparse() -> list[Candidate]:
        def build(dt: torch.dtype) -> Callable[[], Step]:
            def make() -> Step:
                (a, a_t), build_ms = graphs.csr(case.reorder, dt)
                xl = _leaf(x, dt)
                return Step(lambda: _CsrSpmm.apply(xl, a, a_t), (xl,), ("dx",), g.to(dt),
                            info={"build_ms": build_ms, "dtype": _dtype_name(dt)})
            return make
        return [Candidate(f"{_dtype_name(dt)} dx", build(dt)) for dt in _fallback_dtypes(dtype)]

    return CaseInputs(
        reference=reference,
        candidates={"fusegnn": fusegnn, "element": element, "cusparse": cusparse},
        info={"shape": f"A [{graph.num_dst_nodes}, {graph.num_src_nodes}], {graph.num_edges} edges, "
                       f"x [{graph.num_src_nodes}, {features}]",
              "reorder_ms": reorder_ms},
    )
