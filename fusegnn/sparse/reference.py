r"""Pure-PyTorch reference sparse core: the oracle every fused kernel is tested against.

Each function is the textbook gather / apply / scatter written with ``index_select`` and
``index_add_`` (``scatter_add_`` for wide sums on CUDA) / ``scatter_reduce``, so autograd
differentiates it with respect to every
floating input. They run on any device and in any floating dtype; they are meant to be
simple and obviously right, not fast (the gathered ``[E, F]`` message tensor is exactly
the memory cost fuseGNN's fused kernels avoid).

Shapes (``E`` edges ``j -> i``, ``H`` heads, ``F`` features):

* :func:`spmm`: ``x`` ``[N_src, F]`` or ``[N_src, H, F]``, ``edge_weight`` ``[E]`` or
  ``[E, H]`` -> ``[N_dst, F]`` or ``[N_dst, H, F]``;
* :func:`sddmm`: ``a`` ``[N_src, *S]``, ``b`` ``[N_dst, *S]`` -> ``[E, *S]`` (elementwise
  ops) or ``[E, *S[:-1]]`` (``"dot"``);
* :func:`edge_softmax`: ``scores`` ``[E, *S]`` -> ``[E, *S]``;
* :func:`edge_aggregate`: ``x`` ``[N_src, (H,) F]`` and / or ``edge_attr`` ``[E, (H,) F]``,
  ``edge_weight`` ``[E]`` or ``[E, H]`` -> ``[N_dst, (H,) F]``;
* :func:`gat_attention`: ``h`` ``[N_src, H, C]``, scores ``[N_src, H]`` / ``[N_dst, H]``
  -> ``([N_dst, H, C], alpha [E, H])``.

Their closed-form gradients (for the ``torch.library`` ops, which cannot run autograd)
are in :mod:`fusegnn.sparse.reference_grads`.

Inputs are assumed valid here; :mod:`fusegnn.sparse.ops` checks them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.sparse.graph import Graph

__all__ = [
    "spmm", "sddmm", "edge_softmax", "gat_attention", "gatv2_attention", "per_edge", "seeded_dropout_scale",
    "edge_aggregate", "edge_messages", "reduce_messages", "max_and_argmax",
]


def per_edge(weight: Tensor, like: Tensor) -> Tensor:
    """View ``[E]`` or ``[E, H]`` weights so they broadcast against ``[E, (H,) F]``."""
    return weight.reshape(weight.shape + (1,) * (like.dim() - weight.dim()))


def spmm(
    graph: Graph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum", bias: Tensor | None = None
) -> Tensor:
    r"""Aggregate source features into targets, plus an optional bias.

    .. math::
        \mathrm{out}_i = \bigoplus_{(j \to i) \in E} w_{ji} \, x_j \; + \; b

    with :math:`\bigoplus` a sum (``"sum"``), a mean over the incoming edges (``"mean"``)
    or an elementwise maximum (``"max"``, ties to the lowest edge id:
    :func:`max_and_argmax`); targets without incoming edges get zeros (then ``b``).
    """
    out = _aggregate(graph, x, edge_weight, reduce)
    if bias is None:
        return out
    return out + (bias if bias.shape == x.shape[1:] else bias.reshape(x.shape[1:]))  # no view node when it fits


def _aggregate(graph: Graph, x: Tensor, edge_weight: Tensor | None, reduce: str) -> Tensor:
    messages = x.index_select(0, graph.src.long())
    if edge_weight is not None:
        messages = messages * per_edge(edge_weight.to(x.dtype), messages)
    return reduce_messages(graph, messages, reduce)


#: values per edge from which a sum on CUDA scatters with ``scatter_add_`` (the index
#: broadcast over the features) rather than ``index_add_``: the same sums, faster on wide
#: rows -- H100, PubMed's 88,648 edges (forward): 500 columns 304 against 440 us, 64
#: columns 79 against 102 us, Cora's 1,433 columns 107 against 161 us; at 3 columns
#: ``index_add_`` is faster (18 against 23 us) (``benchmarks/NOTES-overhead.md``, session 17)
SCATTER_ADD_MIN_WIDTH = 16


def scatter_add_is_faster(messages: Tensor) -> bool:
    """Whether :func:`reduce_messages` sums ``messages`` with ``scatter_add_``: on CUDA, at
    least :data:`SCATTER_ADD_MIN_WIDTH` values per edge, and not under
    ``torch.use_deterministic_algorithms`` (which keeps ``index_add_``'s deterministic path)."""
    return (messages.is_cuda and math.prod(messages.shape[1:]) >= SCATTER_ADD_MIN_WIDTH
            and not torch.are_deterministic_algorithms_enabled())


def reduce_messages(graph: Graph, messages: Tensor, reduce: str) -> Tensor:
    """Reduce per-edge ``messages`` (``[E, ...]``) into their targets (``[N_dst, ...]``) by
    ``"sum"``, ``"mean"`` or ``"max"`` (:func:`max_and_argmax`); zeros where no edge arrives."""
    if reduce == "max":
        return max_and_argmax(graph, messages)[0]
    dst = graph.dst.long()
    out = messages.new_zeros((graph.num_dst_nodes,) + tuple(messages.shape[1:]))
    if scatter_add_is_faster(messages):
        out.scatter_add_(0, dst.view((-1,) + (1,) * (messages.dim() - 1)).expand_as(messages), messages)
    else:
        out.index_add_(0, dst, messages)
    if reduce == "mean":
        out = out / mean_divisor(graph, messages.dtype, messages.dim())
    return out


def mean_divisor(graph: Graph, dtype: torch.dtype, dim: int) -> Tensor:
    """max(in-degree, 1) as ``dtype``, shaped ``[N_dst, 1, ...]`` to divide ``dim``-D sums;
    cached on the graph's structure (two ATen ops fewer in every eager mean). Not cached
    under ``torch.inference_mode()``: an inference tensor in the cache could not be saved
    for the backward of a later training step (the division saves its divisor)."""
    def compute() -> Tensor:
        return graph.in_degree.clamp(min=1).to(dtype).reshape((-1,) + (1,) * (dim - 1))
    if torch.is_inference_mode_enabled():
        return compute()
    return graph.cached(f"mean_divisor:{dtype}:{dim}", compute, structural=True)


def max_and_argmax(graph: Graph, messages: Tensor) -> tuple[Tensor, Tensor]:
    r"""Elementwise maximum of each target's incoming ``messages`` and the edge that gives it.

    Returns ``(out, argmax)``, both ``[N_dst, ...]``: ``argmax`` holds COO edge ids (int64),
    ``-1`` where no edge arrives (``out`` is 0 there). **Ties go to the lowest edge id**
    (the fused kernels' rule: :mod:`fusegnn.kernels.edge_aggregate`), and the gradient of
    ``out`` flows to that one message only (``out`` is a ``gather`` of it).
    """
    dst = graph.dst.long()
    num_edges = messages.size(0)
    shape = (graph.num_dst_nodes,) + tuple(messages.shape[1:])
    index = dst.reshape((-1,) + (1,) * (messages.dim() - 1)).expand_as(messages)
    with torch.no_grad():
        top = messages.new_full(shape, float("-inf")).scatter_reduce(
            0, index, messages.detach(), reduce="amax", include_self=True
        )
        ids = torch.arange(num_edges, device=messages.device).reshape(index.shape[:1] + (1,) * (messages.dim() - 1))
        candidates = torch.where(messages.detach() == top.index_select(0, dst), ids, num_edges)
        argmax = torch.full(shape, num_edges, dtype=torch.int64, device=messages.device).scatter_reduce(
            0, index, candidates.expand_as(messages), reduce="amin", include_self=True
        )
        argmax = torch.where(argmax == num_edges, -1, argmax)
    found = argmax >= 0
    if num_edges == 0:  # zeros, still a function of the (empty) messages for autograd
        return messages.new_zeros(shape).index_add_(0, dst, messages), argmax
    out = messages.gather(0, argmax.clamp(min=0))
    return torch.where(found, out, torch.zeros_like(out)), argmax


def edge_messages(
    graph: Graph, x: Tensor | None, edge_attr: Tensor | None, edge_weight: Tensor | None, activation: str | None
) -> Tensor:
    r"""The per-edge messages :math:`m_{ji} = w_{ji}\,\mathrm{act}(x_j + e_{ji})` (``[E, ...]``;
    a missing ``x`` or ``edge_attr`` is a zero term, a missing weight 1)."""
    z = x.index_select(0, graph.src.long()) if x is not None else None
    if edge_attr is not None:
        z = edge_attr if z is None else z + edge_attr
    if activation == "relu":
        z = F.relu(z)
    if edge_weight is not None:
        z = z * per_edge(edge_weight.to(z.dtype), z)
    return z


def edge_aggregate(
    graph: Graph, x: Tensor | None = None, edge_attr: Tensor | None = None, edge_weight: Tensor | None = None,
    activation: str | None = None, reduce: str = "sum",
) -> Tensor:
    r"""Aggregate per-edge messages built from source rows and edge rows.

    .. math::
        \mathrm{out}_i = \bigoplus_{(j \to i) \in E} w_{ji}\, \mathrm{act}(x_j + e_{ji})

    with :math:`\bigoplus` as in :func:`spmm` (``"max"``: :func:`max_and_argmax`). ``x``
    ``[N_src, (H,) F]`` and ``edge_attr`` ``[E, (H,) F]`` (either may be ``None``),
    ``edge_weight`` ``[E]`` or ``[E, H]``, ``activation`` ``None`` or ``"relu"``.
    """
    return reduce_messages(graph, edge_messages(graph, x, edge_attr, edge_weight, activation), reduce)


def sddmm(graph: Graph, a: Tensor, b: Tensor, op: str = "dot") -> Tensor:
    r"""One value per edge from its source row of ``a`` and its target row of ``b``.

    .. math::
        s_{ji} = a_j \odot b_i, \qquad \odot \in \{\cdot\ (\text{dot}), +, -, \times\}

    ``"dot"`` reduces the last axis; the elementwise ops keep it.
    """
    a_src = a.index_select(0, graph.src.long())
    b_dst = b.index_select(0, graph.dst.long())
    if op == "dot":
        return (a_src * b_dst).sum(dim=-1)
    if op == "add":
        return a_src + b_dst
    if op == "sub":
        return a_src - b_dst
    if op == "mul":
        return a_src * b_dst
    raise ValueError(f"unknown sddmm op {op!r}")


def edge_softmax(graph: Graph, scores: Tensor) -> Tensor:
    r"""Softmax over the incoming edges of each target, separately per head.

    .. math::
        \alpha_{ji} = \frac{\exp(s_{ji} - m_i)}{\sum_{(k \to i) \in E} \exp(s_{ki} - m_i)},
        \qquad m_i = \max_{(k \to i) \in E} s_{ki}

    Subtracting the (gradient-free) maximum changes nothing mathematically and keeps
    ``exp`` finite. A target whose scores are all ``-inf`` (fully masked) gets zeros,
    not NaN; a target with no edges contributes nothing.
    """
    dst = graph.dst.long()
    index = dst.reshape((-1,) + (1,) * (scores.dim() - 1)).expand_as(scores)
    group_shape = (graph.num_dst_nodes,) + tuple(scores.shape[1:])
    with torch.no_grad():
        group_max = scores.new_full(group_shape, float("-inf")).scatter_reduce(
            0, index, scores.detach(), reduce="amax", include_self=True
        )
        group_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
    exp = torch.exp(scores - group_max.index_select(0, dst))
    denom = scores.new_zeros(group_shape).index_add_(0, dst, exp)
    denom = denom.index_select(0, dst)
    return exp / torch.where(denom > 0, denom, torch.ones_like(denom))


def seeded_dropout_scale(alpha: Tensor, p: float, seed: Tensor) -> Tensor:
    """The dropout factors of ``alpha``'s entries (0 for a dropped one, ``1 / (1 - p)`` for
    a kept one), drawn from a generator seeded with ``seed`` (a one-element integer
    tensor), so that a backward that recomputes them draws the same mask."""
    gen = torch.Generator(device=alpha.device)
    gen.manual_seed(int(seed.item()))
    keep = torch.rand(alpha.shape, generator=gen, device=alpha.device) >= p
    return keep.to(alpha.dtype) * (1.0 / (1.0 - p))


def gat_attention(
    graph: Graph, h: Tensor, score_src: Tensor, score_dst: Tensor, negative_slope: float, p: float = 0.0,
    seed: Tensor | None = None, score_edge: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""GAT attention as the composition ``sddmm(add) -> (+ score_edge) -> leaky_relu ->
    edge_softmax -> dropout -> spmm``:

    .. math::
        \alpha_{ji} = \operatorname{dropout}_p\big(\operatorname{softmax}_{j \to i}
        \mathrm{LeakyReLU}(s_j + t_i + u_{ji})\big), \qquad \mathrm{out}_i = \sum_{j \to i} \alpha_{ji} h_j

    with :math:`u` = ``score_edge`` (``[E, H]`` in the graph's edge order; 0 when ``None``).

    Returns ``(out, alpha)`` (``alpha`` after dropout). The dropout mask comes from torch's
    global generator (``F.dropout``), or, given a ``seed``, from
    :func:`seeded_dropout_scale` (what the compiled op and its backward draw).
    """
    z = sddmm(graph, score_src, score_dst, "add")
    if score_edge is not None:
        z = z + score_edge
    alpha = edge_softmax(graph, F.leaky_relu(z, negative_slope))
    if p > 0.0:
        alpha = F.dropout(alpha, p=p) if seed is None else alpha * seeded_dropout_scale(alpha, p, seed)
    return spmm(graph, h, alpha), alpha


def gatv2_attention(
    graph: Graph, x_l: Tensor, x_r: Tensor, att: Tensor, edge_attr: Tensor | None, negative_slope: float,
    p: float = 0.0, seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""GATv2 attention (Brody et al., 2022) as gathers, an edge softmax and an SpMM:

    .. math::
        s_{ji} = a \cdot \mathrm{LeakyReLU}\big(x^l_j + x^r_i \,(+\, e_{ji})\big), \quad
        \alpha_{ji} = \operatorname{dropout}_p\big(\operatorname{softmax}_{j \to i} s_{ji}\big), \quad
        \mathrm{out}_i = \sum_{j \to i} \alpha_{ji} x^l_j

    per head, with ``x_l`` ``[N_src, H, C]``, ``x_r`` ``[N_dst, H, C]``, ``att``
    ``[1, H, C]`` and ``edge_attr`` ``[E, H, C]`` or ``None``. Materialises ``[E, H, C]``.
    Returns ``(out, alpha)`` (``alpha`` ``[E, H]`` after dropout; the mask as in
    :func:`gat_attention`).
    """
    z = sddmm(graph, x_l, x_r, "add")
    if edge_attr is not None:
        z = z + edge_attr
    scores = (F.leaky_relu(z, negative_slope) * att.reshape(1, *x_l.shape[1:])).sum(-1)
    alpha = edge_softmax(graph, scores)
    if p > 0.0:
        alpha = F.dropout(alpha, p=p) if seed is None else alpha * seeded_dropout_scale(alpha, p, seed)
    return spmm(graph, x_l, alpha), alpha
