r"""Closed-form gradients of the reference ops of :mod:`fusegnn.sparse.reference`.

Eagerly the reference ops are differentiated by autograd (ATen ops with C++ backward
nodes). A ``torch.library`` custom op (:mod:`fusegnn.sparse.library`) runs below the
autograd dispatch keys, so its backward cannot replay autograd: it calls these functions,
plain tensor code written with the reference's own gathers and scatters, each the
gradient of the reference op of the same name. Every function returns ``None`` for a
gradient that is not needed.

Where the forward kept nothing the backward can use, it is **recomputed** (E-sized tensor
ops): ``spmm`` with ``reduce="max"`` its messages and maxima, ``gat_attention`` its scores,
softmax and (from the same ``seed``) dropout mask, ``gcn_norm`` its degrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.sparse import reference
from fusegnn.sparse.graph import Graph
from fusegnn.sparse.processing import self_loop_structure
from fusegnn.sparse.reference import per_edge

__all__ = [
    "spmm_backward", "edge_aggregate_backward", "sddmm_backward", "edge_softmax_backward",
    "gat_attention_backward", "gatv2_attention_backward", "gcn_norm_weight_grad",
]


def spmm_backward(
    graph: Graph, grad: Tensor, x: Tensor | None, w: Tensor | None, reduce: str, need_x: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_x, grad_w)`` of :func:`fusegnn.sparse.reference.spmm` in closed form.

    ``"max"`` recomputes the messages and their argmax (the forward; nothing of size ``E``
    is kept) and gives each target's gradient to the one message that is its maximum
    (ties: the lowest edge id, :func:`fusegnn.sparse.reference.max_and_argmax`).
    """
    src, dst = graph.src.long(), graph.dst.long()
    if reduce == "max":
        gx, _, gw = edge_aggregate_backward(graph, grad, x, None, w, None, "max", need_x, False, need_w)
        return gx, gw
    if reduce == "mean":
        count = graph.in_degree.clamp(min=1).to(grad.dtype)
        grad = grad / count.reshape((-1,) + (1,) * (grad.dim() - 1))
    gx = gw = None
    if need_x:
        gx = reference.spmm(graph.reversed(), grad, w, "sum")
    if need_w:
        prod = x.index_select(0, src) * grad.index_select(0, dst)
        gw = (prod.flatten(1).sum(1) if w.dim() == 1 else prod.sum(-1)).to(w.dtype)
    return gx, gw


def edge_aggregate_backward(
    graph: Graph, grad: Tensor, x: Tensor | None, edge_attr: Tensor | None, w: Tensor | None,
    activation: str | None, reduce: str, need_x: bool, need_e: bool, need_w: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    r"""``(grad_x, grad_edge_attr, grad_w)`` of :func:`fusegnn.sparse.reference.edge_aggregate`
    in closed form. With :math:`z = x_j + e_{ji}`, :math:`g_e` the gradient of edge
    ``e``'s message (its target's output gradient; divided by the in-degree for
    ``"mean"``; for ``"max"`` zero where another edge is the argmax, which is recomputed):
    :math:`\delta_e = w_e g_e \odot \mathrm{act}'(z_e)`, ``grad_x`` sums
    :math:`\delta_e` into the sources, ``grad_edge_attr`` is :math:`\delta`, and
    ``grad_w`` is :math:`\langle \mathrm{act}(z_e), g_e \rangle` per head.
    """
    src, dst = graph.src.long(), graph.dst.long()
    z = x.index_select(0, src) if x is not None else None
    if edge_attr is not None:
        z = edge_attr if z is None else z + edge_attr
    z = z.to(grad.dtype)
    act = F.relu(z) if activation == "relu" else z
    if reduce == "mean":
        count = graph.in_degree.clamp(min=1).to(grad.dtype)
        grad = grad / count.reshape((-1,) + (1,) * (grad.dim() - 1))
    g = grad.index_select(0, dst)
    if reduce == "max":
        messages = act * per_edge(w.to(act.dtype), act) if w is not None else act
        _, argmax = reference.max_and_argmax(graph, messages)
        ids = torch.arange(graph.num_edges, device=g.device).reshape((-1,) + (1,) * (g.dim() - 1))
        g = torch.where(argmax.index_select(0, dst) == ids, g, torch.zeros_like(g))
    delta = g * per_edge(w.to(g.dtype), g) if w is not None else g
    if activation == "relu":
        delta = torch.where(z > 0, delta, torch.zeros_like(delta))
    gx = torch.zeros_like(x).index_add_(0, src, delta.to(x.dtype)) if need_x and x is not None else None
    ge = delta.to(edge_attr.dtype) if need_e and edge_attr is not None else None
    gw = None
    if need_w and w is not None:
        prod = act * g
        gw = (prod.flatten(1).sum(1) if w.dim() == 1 else prod.sum(-1)).to(w.dtype)
    return gx, ge, gw


def sddmm_backward(
    graph: Graph, a: Tensor, b: Tensor, grad: Tensor, op: str, need_a: bool, need_b: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_a, grad_b)`` of :func:`fusegnn.sparse.reference.sddmm` in closed form:
    per-edge gradients (times the other operand for ``dot`` / ``mul``) summed into the
    source rows of ``a`` and the target rows of ``b``."""
    src, dst = graph.src.long(), graph.dst.long()
    g = grad.unsqueeze(-1) if op == "dot" else grad
    ga = gb = None
    if need_a:
        per_edge = g * b.index_select(0, dst) if op in ("dot", "mul") else g.expand((g.size(0),) + tuple(a.shape[1:]))
        ga = torch.zeros_like(a).index_add_(0, src, per_edge.to(a.dtype))
    if need_b:
        per_edge = g * a.index_select(0, src) if op in ("dot", "mul") else g.expand((g.size(0),) + tuple(b.shape[1:]))
        if op == "sub":
            per_edge = -per_edge
        gb = torch.zeros_like(b).index_add_(0, dst, per_edge.to(b.dtype))
    return ga, gb


def edge_softmax_backward(graph: Graph, alpha: Tensor, grad: Tensor) -> Tensor:
    r"""Gradient of the scores of :func:`fusegnn.sparse.reference.edge_softmax` from its
    output ``alpha`` alone:

    .. math::
        \frac{\partial L}{\partial s_{ji}} = \alpha_{ji}\Big(g_{ji} - \sum_{k \to i} \alpha_{ki} g_{ki}\Big)
    """
    dst = graph.dst.long()
    weighted = alpha * grad
    totals = weighted.new_zeros((graph.num_dst_nodes,) + tuple(alpha.shape[1:])).index_add_(0, dst, weighted)
    return weighted - alpha * totals.index_select(0, dst)


def _score_grad(graph: Graph, alpha: Tensor, scale: Tensor, grad_out: Tensor, messages: Tensor,
                grad_alpha: Tensor | None) -> Tensor:
    r"""Gradient of the pre-softmax scores of attention ``out_i = sum_j alpha_ji scale_ji m_j``
    (``m`` = ``messages``): :math:`dA = (g_i \cdot m_j + \bar w) \cdot scale`,
    :math:`\alpha (dA - \sum_k \alpha_{ki} dA_{ki})` (``grad_alpha`` :math:`\bar w`: the
    gradient of the returned coefficients, or ``None``)."""
    src, dst = graph.src.long(), graph.dst.long()
    d_w = (grad_out.index_select(0, dst) * messages.index_select(0, src)).sum(-1).to(alpha.dtype)
    if grad_alpha is not None:
        d_w = d_w + grad_alpha.to(alpha.dtype)
    d_a = d_w * scale
    row = alpha.new_zeros((graph.num_dst_nodes,) + tuple(alpha.shape[1:])).index_add_(0, dst, alpha * d_a)
    return alpha * (d_a - row.index_select(0, dst))


def gat_attention_backward(
    graph: Graph, h: Tensor, s_src: Tensor, s_dst: Tensor, negative_slope: float, p: float, seed: Tensor | None,
    grad_out: Tensor, grad_alpha: Tensor | None, s_edge: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    r"""``(grad_h, grad_score_src, grad_score_dst, grad_score_edge)`` of
    :func:`fusegnn.sparse.reference.gat_attention` (with a ``seed``) in closed form; the
    last is ``None`` without a per-edge addend ``s_edge``.

    The coefficients are recomputed (the forward's scores and softmax, E-sized, and the
    same dropout mask from ``seed``); then, with :math:`g` the output gradient,
    :math:`w = \alpha M / (1-p)` and :math:`\bar w` the gradient of the returned
    coefficients: :math:`\partial h_j = \sum_i w_{ji} g_i`,
    :math:`dW = g_i \cdot h_j + \bar w`, :math:`dA = dW\, M/(1-p)`,
    :math:`dE = \alpha (dA - \sum_k \alpha_{ki} dA_{ki})`,
    :math:`dZ = dE \cdot (1 \text{ if } z > 0 \text{ else slope})`, summed into sources
    and targets for the two score gradients; :math:`dZ` itself is the gradient of ``s_edge``.
    """
    src, dst = graph.src.long(), graph.dst.long()
    z = reference.sddmm(graph, s_src, s_dst, "add")
    if s_edge is not None:
        z = z + s_edge
    alpha = reference.edge_softmax(graph, F.leaky_relu(z, negative_slope))
    scale = reference.seeded_dropout_scale(alpha, p, seed) if p > 0.0 else torch.ones_like(alpha)
    w = alpha * scale
    grad_h = reference.spmm(graph.reversed(), grad_out, w, "sum")
    d_e = _score_grad(graph, alpha, scale, grad_out, h, grad_alpha)
    d_z = torch.where(z > 0, d_e, d_e * negative_slope)
    grad_src = torch.zeros_like(s_src).index_add_(0, src, d_z.to(s_src.dtype))
    grad_dst = torch.zeros_like(s_dst).index_add_(0, dst, d_z.to(s_dst.dtype))
    grad_edge = d_z.to(s_edge.dtype) if s_edge is not None else None
    return grad_h.to(h.dtype), grad_src, grad_dst, grad_edge


def gcn_norm_weight_grad(
    graph: Graph, weight: Tensor, grad_norm: Tensor, *, improved: bool, add_self_loops: bool, dtype: torch.dtype
) -> Tensor:
    r"""Gradient of the raw weights ``weight`` (``[E]``) from that of the weights
    :func:`~fusegnn.sparse.processing.gcn_norm` makes of them, in closed form (the
    normalisation is recomputed: E-sized tensor ops, the edge structure is cached).

    With :math:`w'` the weights after adding the remaining self-loops,
    :math:`d_n = \sum_{e \to n} w'_e`, :math:`r_n = d_n^{-1/2}` (0 where :math:`d_n = 0`)
    and :math:`\hat w_e = r_{s_e} w'_e r_{t_e}`:

    .. math::
        \frac{\partial L}{\partial w'_k} = G_k r_{s_k} r_{t_k}
        - \tfrac12 r_{t_k}^3 A_{t_k}, \qquad
        A_n = \sum_{s_e = n} G_e w'_e r_{t_e} + \sum_{t_e = n} G_e w'_e r_{s_e}

    then scattered back through the self-loop step (kept edges by position, the weight
    a new self-loop took from its node's last self-loop).
    """
    w = weight.to(dtype)
    if add_self_loops:
        structure = self_loop_structure(graph)
        edges = structure.graph
        fill = 2.0 if improved else 1.0
        loop_w = w.new_full((graph.num_nodes,), fill).index_put(
            (structure.loop_node,), w.index_select(0, structure.loop_edge)
        )
        w_loops = torch.cat([w.index_select(0, structure.keep), loop_w])
    else:
        edges, w_loops = graph, w
    src, dst = edges.src.long(), edges.dst.long()
    deg = w_loops.new_zeros(edges.num_dst_nodes).index_add_(0, dst, w_loops)
    r = deg.pow(-0.5)
    r = torch.where(torch.isinf(r), torch.zeros_like(r), r)
    g = grad_norm.to(w_loops.dtype)
    r_src, r_dst = r.index_select(0, src), r.index_select(0, dst)
    gw = g * w_loops
    a = w_loops.new_zeros(edges.num_dst_nodes).index_add_(0, src, gw * r_dst).index_add_(0, dst, gw * r_src)
    d_deg = -0.5 * r.pow(3) * a
    g_loops = g * r_src * r_dst + d_deg.index_select(0, dst)
    if add_self_loops:
        kept = structure.keep.numel()
        grad_w = torch.zeros_like(w).index_add_(0, structure.keep, g_loops[:kept])
        grad_w = grad_w.index_add_(0, structure.loop_edge, g_loops[kept:].index_select(0, structure.loop_node))
    else:
        grad_w = g_loops
    return grad_w.to(weight.dtype)


def gatv2_attention_backward(
    graph: Graph, x_l: Tensor, x_r: Tensor, att: Tensor, edge_attr: Tensor | None, negative_slope: float,
    p: float, seed: Tensor | None, grad_out: Tensor, grad_alpha: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    r"""``(grad_x_l, grad_x_r, grad_att, grad_edge_attr or None)`` of
    :func:`fusegnn.sparse.reference.gatv2_attention` (with a ``seed``) in closed form.

    Recomputes :math:`z = x^l_j + x^r_i (+ e_{ji})`, the scores, the softmax and the mask;
    then with :math:`w = \alpha M / (1-p)`: :math:`dA = (g_i \cdot x^l_j + \bar w) M/(1-p)`,
    :math:`ds = \alpha (dA - \sum_k \alpha_{ki} dA_{ki})`,
    :math:`dz = ds\, a \odot \mathrm{LeakyReLU}'(z)`; :math:`\partial x^l_j = \sum_i w_{ji} g_i + dz_{ji}`,
    :math:`\partial x^r_i = \sum_j dz_{ji}`, :math:`\partial a = \sum ds \, \mathrm{LeakyReLU}(z)`,
    :math:`\partial e = dz`.
    """
    src, dst = graph.src.long(), graph.dst.long()
    att3 = att.reshape(1, *x_l.shape[1:])
    z = reference.sddmm(graph, x_l, x_r, "add")
    if edge_attr is not None:
        z = z + edge_attr
    lr = F.leaky_relu(z, negative_slope)
    alpha = reference.edge_softmax(graph, (lr * att3).sum(-1))
    scale = reference.seeded_dropout_scale(alpha, p, seed) if p > 0.0 else torch.ones_like(alpha)
    d_s = _score_grad(graph, alpha, scale, grad_out, x_l, grad_alpha)
    d_z = d_s.unsqueeze(-1) * torch.where(z > 0, att3, att3 * negative_slope)
    grad_l = reference.spmm(graph.reversed(), grad_out, alpha * scale, "sum").index_add_(0, src, d_z.to(grad_out.dtype))
    grad_r = torch.zeros_like(x_r).index_add_(0, dst, d_z.to(x_r.dtype))
    grad_att = (d_s.unsqueeze(-1) * lr).sum(0).reshape(att.shape)
    grad_e = d_z.to(edge_attr.dtype) if edge_attr is not None else None
    return grad_l.to(x_l.dtype), grad_r, grad_att.to(att.dtype), grad_e
