r"""Differentiable fused SpMM: one ``torch.autograd.Function`` per path (GAS, GAR).

Both compute :func:`fusegnn.sparse.reference.spmm`,

.. math::
    \mathrm{out}_{i,h} = \sum_{(j \to i) \in E} w_{ji,h}\, x_{j,h}, \qquad
    \frac{\partial L}{\partial x_{j,h}} = \sum_{(j \to i) \in E} w_{ji,h}\, g_{i,h}, \qquad
    \frac{\partial L}{\partial w_{ji,h}} = \langle g_{i,h}, x_{j,h} \rangle,

with ``g = dL/dout``. Shapes: ``x`` ``[N_src, F]`` or ``[N_src, H, F]``; weights ``None``
(all ones), ``[E]`` (shared by every column; the features are then treated as one head
of ``H F`` columns) or ``[E, H]`` (one per head). Accumulation is fp32 for fp16 / bf16 /
fp32 inputs (fp64 for fp64), results are cast back to ``x``'s dtype (promoted with a
bias's, as ``out + bias`` would be: a float32 bias on half ``x`` gives float32), weight
gradients to the weights' dtype.

* **GAS** (:class:`GASSpmm`): forward scatters over the COO edges with atomics; backward
  runs the same kernel with the roles of source and target swapped, and forms the
  weight gradient in the same pass when it is needed. When the scatter row is sorted
  (checked once per graph: the backward of a COO sorted by source) and its runs are
  long enough (:data:`GAS_RUNS_MIN`), runs of equal rows are added up in the program
  before the atomics.
* **GAR** (:class:`GARSpmm`): forward reduces over the CSR segments of
  :mod:`fusegnn.kernels.partition`, backward over the CSC segments, reading the weights
  in CSC order (``w[csc.perm]``) and forming the weight gradient in the same pass
  (heads up to :data:`~fusegnn.kernels.spmm_gar.MAX_DOT_BLOCK_F` features; wider heads
  take a separate edge-parallel dot-product pass). No atomics: bitwise reproducible.

Weights in grouped (CSR / CSC) order are memoised on the graph while the same weight
tensor comes back unchanged and does not require grad (GCN's cached normalisation), so
that transductive training permutes them once.

On GAR, a head wider than 16 columns and not a multiple of 16 runs zero-padded to the
next multiple (:func:`~fusegnn.kernels._edge_utils.padded_channels`): the gathered rows are
then 16-element aligned and load as vectors. The padded copies of ``x`` and of the output
gradient are the price, and results and gradients are sliced back. H100, forward +
backward, the session's previous code in the same run: Reddit-sized graph (GAR), 41
columns 8.12 -> 5.96 ms, 100 columns 20.5 -> 16.1 ms; GAS gains nothing from aligned rows
(a degree-5 graph of 200k nodes: 100 columns unpadded 1.11 ms, 112 natively 1.12, 100
padded 1.35 with the copies), so it runs every width as it comes.

``reduce="mean"`` is the sum divided by the in-degree (clamped to 1), through autograd;
``reduce="max"`` is the GAR max of :mod:`fusegnn.kernels.edge_aggregate` (the op layer
routes it there, for GAS too).

The backward passes are themselves not differentiable (:func:`~fusegnn.kernels._autograd.differentiable_once`): double
backward through a fused SpMM raises ``RuntimeError``; use ``aggregation="reference"``
for higher-order gradients.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import triton
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._edge_utils import pad_heads, padded_channels, unpad_heads
from fusegnn.kernels._reductions import column_sum
from fusegnn.kernels.partition import plan_for
from fusegnn.kernels.spmm_gar import MAX_DOT_BLOCK_F, GarConfig, gar_config, gar_reduce
from fusegnn.kernels.spmm_gas import GasConfig, gas_config, gas_scatter
from fusegnn.sparse.graph import Graph, cache_value

__all__ = ["GASSpmm", "GARSpmm", "gas_spmm", "gar_spmm", "gas_backward", "gar_backward", "spmm_backward", "tuning", "gar_cfg"]

_gas_override: GasConfig | Callable[..., GasConfig] | None = None
_gar_override: GarConfig | Callable[..., GarConfig] | None = None


@contextlib.contextmanager
def tuning(
    gas: GasConfig | Callable[..., GasConfig] | None = None,
    gar: GarConfig | Callable[..., GarConfig] | None = None,
) -> Iterator[None]:
    """Override the launch parameters inside the block (for benchmarks and tuning).

    Each override is a config, or a callable ``(feat, elem_size, dot) -> config``; ``None``
    keeps the override in force outside the block (the defaults outside any), so blocks
    nest. A config is checked here (a callable's result at each launch): ``block_e``,
    ``block_f`` and ``num_warps`` powers of two, GAR's ``seg_len`` and ``num_stages`` >= 1.
    """
    global _gas_override, _gar_override
    saved = _gas_override, _gar_override
    if gas is not None:
        gas = _checked_override("gas", gas, GasConfig)
    if gar is not None:
        gar = _checked_override("gar", gar, GarConfig)
    _gas_override = gas if gas is not None else _gas_override
    _gar_override = gar if gar is not None else _gar_override
    try:
        yield
    finally:
        _gas_override, _gar_override = saved


def _checked_override(name: str, override, kind: type):
    """``override`` (a ``kind`` config or a callable returning one), its config checked."""
    return override if callable(override) else _checked_config(f"tuning({name}=...)", override, kind)


def _checked_config(name: str, cfg, kind: type):
    """``cfg`` if it is a ``kind`` (:class:`GasConfig` / :class:`GarConfig`) the kernels can
    launch: tile sides and warps powers of two, GAR's segments and stages positive; else
    an error naming ``name`` and the field (not a Triton error, nor an empty launch grid,
    later)."""
    if not isinstance(cfg, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, a callable returning one, or None, "
                        f"got {type(cfg).__name__}")
    positive = ("seg_len", "num_stages") if kind is GarConfig else ()
    for field in ("block_e", "block_f", "num_warps", *positive):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        if field not in positive and value & (value - 1):
            raise ValueError(f"{name}.{field} must be a power of two, got {value}")
    return cfg


def _gas_cfg(feat: int, elem_size: int, dot: bool, runs: bool) -> GasConfig:
    if _gas_override is None:
        return gas_config(feat, elem_size)._replace(runs=runs)
    if callable(_gas_override):
        return _checked_config("tuning(gas=...)'s result", _gas_override(feat, elem_size, dot), GasConfig)
    return _gas_override


def gar_cfg(feat: int, elem_size: int, dot: bool, avg_degree: float) -> GarConfig:
    """The GAR launch parameters in force: :func:`tuning`'s override, else :func:`gar_config`
    (also for the other GAR passes, :mod:`fusegnn.kernels.edge_aggregate`)."""
    if _gar_override is None:
        return gar_config(feat, elem_size, dot=dot, avg_degree=avg_degree)
    if callable(_gar_override):
        return _checked_config("tuning(gar=...)'s result", _gar_override(feat, elem_size, dot), GarConfig)
    return _gar_override


# GAS pre-adds runs of equal scatter rows when the scatter row is sorted and
# (average run length) * sqrt(columns) reaches this: on an H200 the scan paid off from
# degree 128 at 16 columns, 64 at 64 columns and 16 at 256 (benchmarks/NOTES-spmm.md).
GAS_RUNS_MIN = 512.0


def _use_runs(graph: Graph, which: str, cols: int) -> bool:
    """Whether GAS should pre-add runs when scattering into ``which`` (``"src"`` or
    ``"dst"``): that row sorted (checked once per graph, cached) and runs long enough."""
    index = graph.src if which == "src" else graph.dst
    num_rows = graph.num_src_nodes if which == "src" else graph.num_dst_nodes
    if graph.num_edges / max(num_rows, 1) * math.sqrt(cols) < GAS_RUNS_MIN:
        return False

    def check() -> bool:
        return index.numel() < 2 or bool((index[1:] >= index[:-1]).all())

    return graph.cached(f"gas_sorted:{which}", check, structural=True)


# --------------------------------------------------------------------------- helpers
def _flatten(graph: Graph, x: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor | None, int]:
    """``x`` as contiguous ``[N, C]``, weights as contiguous ``[E, heads]`` and ``heads``."""
    x2 = x.flatten(1) if x.dim() != 2 else x
    x2 = x2.contiguous()
    if weight is None:
        return x2, None, 1
    if weight.dim() == 1:
        return x2, weight.reshape(-1, 1).contiguous(), 1
    heads = weight.size(1)
    if x.dim() != 3 or x.size(1) != heads:
        raise ValueError(
            f"[E, H] weights need x of shape [N, H={heads}, F], got {tuple(x.shape)}"
        )
    return x2, weight.contiguous(), heads


def _weight_key(weight: Tensor | None) -> tuple | None:
    """Identity of a weight tensor for the grouped-order memo (``None``: do not memoise).

    The key holds the weight's address, so the memo must keep that memory alive
    (:func:`_grouped_weight` keeps the flattened weight, a view of it only when the weight
    is contiguous): a weight that is not contiguous (a column of an ``[E, D]`` tensor) is
    not memoised, else once it died the next tensor in its memory (the CUDA caching
    allocator reuses it at once) had its key and other values."""
    if weight is None or weight.requires_grad or weight.is_inference():  # no version counter
        return None
    if not weight.is_contiguous():  # flattened into a copy, which alone the memo would keep
        return None
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight._version)


def _grouped_weight(graph: Graph, flat: Tensor, order: str, key: tuple | None) -> Tensor:
    """``flat`` (``[E, heads]``) in CSR or CSC order, memoised on the graph under ``key``."""
    perm = graph.csr.perm if order == "csr" else graph.csc.perm
    if key is None:
        return flat.index_select(0, perm)
    memo = graph.cached("gar_weight_memo", dict)
    hit = memo.get(order)
    if hit is not None and hit[0] == key:
        return hit[2]
    grouped = cache_value(lambda: flat.index_select(0, perm), graph.device)  # kept across calls
    memo[order] = (key, flat.detach(), grouped)  # the detached view keeps the storage alive
    return grouped


def _indices(graph: Graph) -> tuple[Tensor, Tensor]:
    """The COO source and target rows, contiguous (built once per graph)."""
    return graph.cached("coo_contiguous", lambda: (graph.src.contiguous(), graph.dst.contiguous()), structural=True)


def _flat_bias(bias: Tensor | None, cols: int) -> Tensor | None:
    """``bias`` as ``[C]`` (one value per column of the flattened output), or ``None``."""
    if bias is None:
        return None
    if bias.numel() != cols:
        raise ValueError(f"bias must have one value per output column ({cols}), got shape {tuple(bias.shape)}")
    return bias.reshape(cols)


def _out_dtype(x: Tensor, bias: Tensor | None) -> torch.dtype:
    """The SpMM's result dtype: ``x``'s, promoted with the bias's (torch's rule for
    ``spmm(x) + bias``: a float32 bias on half ``x`` under autocast gives float32)."""
    return x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)


def _fits_accumulator(bias: Tensor, x: Tensor) -> bool:
    """Whether the accumulator (fp32, fp64 for fp64 ``x``) holds ``bias`` exactly."""
    return x.dtype == torch.float64 or bias.dtype != torch.float64


def _save_dtypes(ctx, x: Tensor, bias: Tensor | None) -> None:
    """What the backward casts to: the output gradient to ``x``'s dtype (the gradient of
    the promotion), the bias gradient to the bias's."""
    ctx.x_dtype = x.dtype
    if bias is not None:
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype


def _bias_grad(ctx, g2: Tensor) -> Tensor | None:
    """``dL/dbias``: the column sums of the flattened output gradient, in bias's shape."""
    if not ctx.needs_input_grad[2]:
        return None
    return column_sum(g2).to(ctx.bias_dtype).reshape(ctx.bias_shape)


# --------------------------------------------------------------------------- GAS
class GASSpmm(torch.autograd.Function):
    """Fused GAS SpMM (sum), plus an optional bias on every output row:
    ``apply(x, weight, bias, graph)``; differentiable in ``x``, ``weight`` and ``bias``,
    once. The bias is the accumulator's starting value (no separate pass)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, graph: Graph) -> Tensor:  # type: ignore[override]
        x2, w2, heads = _flatten(graph, x, weight)
        feat = x2.size(1) // max(heads, 1)  # [E, 0] weights: no heads, no columns
        src, dst = _indices(graph)
        out_dtype = _out_dtype(x, bias)
        flat_bias = _flat_bias(bias, x2.size(1))
        # the bias starts the accumulator unless it is wider than it (float64 on float32 x)
        fused_bias = flat_bias if flat_bias is not None and _fits_accumulator(flat_bias, x) else None
        acc, _ = gas_scatter(
            x2, src, dst, w2, graph.num_dst_nodes, heads,
            config=_gas_cfg(feat, x2.element_size(), False, _use_runs(graph, "dst", x2.size(1))),
            initial=fused_bias,
        )
        out = acc if acc.dtype == out_dtype else acc.to(out_dtype)
        if flat_bias is not None and fused_bias is None:
            out.add_(flat_bias)  # the kernel's fresh output: no autograd
        _save_dtypes(ctx, x, bias)
        ctx.graph, ctx.heads = graph, heads
        ctx.w_shape = weight.shape if weight is not None else None
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, w2)
        return out.view((graph.num_dst_nodes,) + tuple(x.shape[1:]))

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x2, w2 = ctx.saved_tensors
        grad_x, grad_w = gas_backward(
            ctx.graph, grad_out.to(ctx.x_dtype), x2, w2, ctx.heads, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        grad_w = grad_w.reshape(ctx.w_shape) if grad_w is not None else None
        return grad_x, grad_w, _bias_grad(ctx, grad_out.flatten(1)), None


def gas_backward(
    graph: Graph, grad_out: Tensor, x2: Tensor | None, w2: Tensor | None, heads: int,
    need_x: bool, need_w: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the GAS SpMM (sum): ``(grad_x, grad_w)``, each ``None`` unless needed.

    ``grad_out`` is ``[N_dst, ...]``; ``x2`` the forward's ``x`` flattened to a contiguous
    ``[N_src, C]`` (needed only for ``grad_w``), ``w2`` its weights as contiguous
    ``[E, heads]`` (:func:`_flatten`). ``grad_x`` has ``x``'s shape, ``N_src`` rows and
    ``grad_out``'s trailing shape; ``grad_w`` is ``[E, heads]`` in the weights' dtype.
    """
    g = grad_out.flatten(1).contiguous()
    feat = g.size(1) // max(heads, 1)
    src, dst = _indices(graph)
    acc, gw = gas_scatter(
        g, dst, src, w2, graph.num_src_nodes, heads,
        dot_with=x2 if need_w else None,
        scatter=need_x,
        config=_gas_cfg(feat, g.element_size(), need_w, need_x and _use_runs(graph, "src", g.size(1))),
    )
    grad_x = acc.to(grad_out.dtype).reshape((graph.num_src_nodes,) + tuple(grad_out.shape[1:])) if need_x else None
    return grad_x, (gw if need_w else None)


# --------------------------------------------------------------------------- GAR
class GARSpmm(torch.autograd.Function):
    """Fused GAR SpMM (sum), plus an optional bias on every output row:
    ``apply(x, weight, bias, graph)``; differentiable in ``x``, ``weight`` and ``bias``,
    once."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, graph: Graph) -> Tensor:  # type: ignore[override]
        x2, w2, heads = _flatten(graph, x, weight)
        feat = x2.size(1) // max(heads, 1)  # [E, 0] weights: no heads, no columns
        run_feat = padded_channels(feat)  # aligned rows (module docstring)
        cfg = gar_cfg(run_feat, x2.element_size(), False, graph.avg_degree)
        plan = plan_for(graph, "csr", cfg.seg_len)
        key = _weight_key(weight)
        w_csr = _grouped_weight(graph, w2, "csr", key) if w2 is not None else None
        # the padded copy lives for the kernel only: the backward pads what it saves itself
        out, _ = gar_reduce(plan, pad_heads(x2, heads, run_feat), w_csr, graph.num_dst_nodes, heads,
                            _out_dtype(x, bias), config=cfg)
        out = unpad_heads(out, heads, feat)
        if bias is not None:
            out.add_(_flat_bias(bias, out.size(1)))  # the kernel's fresh output: no autograd
        _save_dtypes(ctx, x, bias)
        ctx.graph, ctx.heads = graph, heads
        ctx.w_shape = weight.shape if weight is not None else None
        ctx.weight_key = key
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, w2)
        return out.view((graph.num_dst_nodes,) + tuple(x.shape[1:]))

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x2, w2 = ctx.saved_tensors
        grad_x, grad_w = gar_backward(
            ctx.graph, grad_out.to(ctx.x_dtype), x2, w2, ctx.heads, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            weight_key=ctx.weight_key,
        )
        grad_w = grad_w.reshape(ctx.w_shape) if grad_w is not None else None
        return grad_x, grad_w, _bias_grad(ctx, grad_out.flatten(1)), None


def gar_backward(
    graph: Graph, grad_out: Tensor, x2: Tensor | None, w2: Tensor | None, heads: int,
    need_x: bool, need_w: bool, *, weight_key: tuple | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the GAR SpMM (sum): ``(grad_x, grad_w)``, each ``None`` unless needed.

    Arguments as for :func:`gas_backward`; ``weight_key`` (:func:`_weight_key` of the
    forward's weights, ``None`` for weights that require grad) lets the CSC-ordered
    weights be memoised on the graph. ``grad_x`` comes from one reduction over the CSC
    segments, which also forms ``grad_w`` for heads of up to
    :data:`~fusegnn.kernels.spmm_gar.MAX_DOT_BLOCK_F` features; wider heads (or
    ``grad_w`` alone) take an edge-parallel dot-product pass.
    """
    g = grad_out.flatten(1).contiguous()
    feat = g.size(1) // max(heads, 1)
    run_feat = padded_channels(feat)  # the forward's aligned rows (module docstring)
    g = pad_heads(g, heads, run_feat)
    if need_w:
        x2 = pad_heads(x2, heads, run_feat)
    grad_x = gw = None
    if need_x:
        fuse_dot = need_w and triton.next_power_of_2(max(run_feat, 1)) <= MAX_DOT_BLOCK_F
        avg = graph.num_edges / max(graph.num_src_nodes, 1)
        cfg = gar_cfg(run_feat, g.element_size(), fuse_dot, avg)
        fuse_dot = fuse_dot and cfg.block_f >= run_feat  # an override may not span the head
        plan = plan_for(graph, "csc", cfg.seg_len)
        w_csc = _grouped_weight(graph, w2, "csc", weight_key) if w2 is not None else None
        gx, gw = gar_reduce(
            plan, g, w_csc, graph.num_src_nodes, heads, grad_out.dtype,
            dot_with=x2 if fuse_dot else None,
            gw_dtype=w2.dtype if w2 is not None else None,
            config=cfg,
        )
        grad_x = unpad_heads(gx, heads, feat).reshape((graph.num_src_nodes,) + tuple(grad_out.shape[1:]))
    if need_w and gw is None:
        src, dst = _indices(graph)
        _, gw = gas_scatter(
            g, dst, src, w2, graph.num_src_nodes, heads,
            dot_with=x2, scatter=False,
            config=_gas_cfg(run_feat, g.element_size(), True, False),
        )
    return grad_x, (gw if need_w else None)


def spmm_backward(
    aggregation: str, graph: Graph, grad_out: Tensor, x: Tensor | None, weight: Tensor | None,
    need_x: bool, need_w: bool, *, memoise_weight: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the fused sum SpMM of ``aggregation`` (``"gas"`` / ``"gar"``) as a plain function,
    for callers outside autograd (the ``torch.library`` ops of
    :mod:`fusegnn.sparse.library`): ``(grad_x, grad_weight)`` with the shapes of ``x``
    and ``weight``, each ``None`` unless needed.

    ``x`` (the forward's features) is read only for ``grad_weight``; ``weight`` is the
    forward's ``[E]`` / ``[E, H]`` weights or ``None``. ``memoise_weight`` lets GAR keep
    the weights in CSC order on the graph (for weights that are the same tensor from
    call to call, like a cached normalisation).
    """
    x2 = None
    if need_w:
        if x is None:
            raise ValueError("spmm_backward needs x to form the weight gradient")
        x2 = x.flatten(1).contiguous()
    w2, heads = None, 1
    if weight is not None:
        w2 = weight.reshape(-1, 1).contiguous() if weight.dim() == 1 else weight.contiguous()
        heads = 1 if weight.dim() == 1 else weight.size(1)
    if aggregation == "gas":
        grad_x, grad_w = gas_backward(graph, grad_out, x2, w2, heads, need_x, need_w)
    elif aggregation == "gar":
        key = _weight_key(weight) if memoise_weight and not need_w else None
        grad_x, grad_w = gar_backward(graph, grad_out, x2, w2, heads, need_x, need_w, weight_key=key)
    else:
        raise ValueError(f"aggregation must be 'gas' or 'gar', got {aggregation!r}")
    if grad_w is not None:
        grad_w = grad_w.reshape(weight.shape)
    return grad_x, grad_w


# --------------------------------------------------------------------------- entry points
def _run(fn: type[torch.autograd.Function], name: str, graph: Graph, x: Tensor,
         edge_weight: Tensor | None, reduce: str, bias: Tensor | None) -> Tensor:
    if reduce == "sum":
        return fn.apply(x, edge_weight, bias, graph)
    if reduce != "mean":
        raise ValueError(f"{name}: the fused SpMM reduces by 'sum' or 'mean', got {reduce!r}")
    out = fn.apply(x, edge_weight, None, graph)
    count = graph.in_degree.clamp(min=1).to(out.dtype)
    out = out / count.reshape((-1,) + (1,) * (out.dim() - 1))
    return out if bias is None else out + bias.reshape(x.shape[1:])


def gas_spmm(graph: Graph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum",
             bias: Tensor | None = None) -> Tensor:
    """:func:`fusegnn.sparse.reference.spmm` through the fused GAS kernels."""
    return _run(GASSpmm, "gas", graph, x, edge_weight, reduce, bias)


def gar_spmm(graph: Graph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum",
             bias: Tensor | None = None) -> Tensor:
    """:func:`fusegnn.sparse.reference.spmm` through the fused GAR kernels."""
    return _run(GARSpmm, "gar", graph, x, edge_weight, reduce, bias)
