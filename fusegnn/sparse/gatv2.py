r"""GATv2 graph attention as one op: per-edge scores, LeakyReLU, edge softmax, dropout, SpMM.

For every head and edge :math:`j \to i` (Brody et al., "How Attentive are Graph
Attention Networks?", ICLR 2022):

.. math::
    s_{ji} = a \cdot \mathrm{LeakyReLU}\big(x^l_j + x^r_i \,(+\, e_{ji})\big), \qquad
    \alpha_{ji} = \operatorname{dropout}_p\Big(\operatorname{softmax}_{j \to i}\, s_{ji}\Big),
    \qquad
    \mathrm{out}_i = \sum_{j \to i} \alpha_{ji} \, x^l_j

with :math:`x^l = \Theta_s x_{src}`, :math:`x^r = \Theta_t x_{dst}` and :math:`e` the
projected edge features (PyG's ``GATv2Conv``). Unlike GAT's, the score is no sum of a
source and a target term, so it cannot be precomputed per node.

Two implementations:

* the **reference composition** of :func:`fusegnn.sparse.reference.gatv2_attention`
  (``aggregation="reference"``, and ``"auto"`` off CUDA), which materialises ``[E, H, C]``;
* the **fused kernels** of :mod:`fusegnn.kernels.gatv2_fused` (``"gar"`` / ``"gas"``;
  ``"auto"`` on CUDA): one pass over each target's edges with an online softmax, a fused
  backward that recomputes the scores, nothing of size ``[E, H, C]`` stored but the edge
  features' own gradient. ``"gar"`` is atomic-free (deterministic mode's choice);
  ``"gas"`` scatters the source gradient with atomics. On the CPU they run only when
  asked for, under the Triton interpreter (``TRITON_INTERPRET=1``).

Dropout on the fused path regenerates its keep mask from a counter-based RNG (as the
fused GAT kernels do); ``return_alpha=True`` runs the reference (the fused kernels do not
return the coefficients), which :func:`fusegnn.sparse.dispatch.last_decision` records.

Under ``torch.compile`` the op is one ``torch.library`` custom op,
``fusegnn::gatv2_attention`` (:mod:`fusegnn.sparse.library`).
"""

from __future__ import annotations

from torch import Tensor

from fusegnn.sparse import library, reference
from fusegnn.sparse.dispatch import note_path, resolve_aggregation
from fusegnn.sparse.graph import Graph
from fusegnn.sparse.graph_ref import GraphRef
from fusegnn.sparse.halo import with_halo_rows
from fusegnn.sparse.ops import check_node_tensor, graph_arg
from fusegnn.sparse.gat import attention_options

__all__ = ["gatv2_attention"]


def _check_like(t: Tensor | None, name: str, shape: tuple, x_l: Tensor) -> None:
    """``t`` is a tensor of ``shape`` (``-1``: any size) with ``x_l``'s dtype and device."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    fits = t.dim() == len(shape) and all(want < 0 or got == want for got, want in zip(t.shape, shape))
    if not fits:
        want = ", ".join("?" if s < 0 else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {tuple(t.shape)}")
    if t.dtype != x_l.dtype:
        raise TypeError(f"{name} must have x_l's dtype {x_l.dtype}, got {t.dtype}")
    if t.device != x_l.device:
        raise ValueError(f"{name} is on {t.device} but x_l is on {x_l.device}; move them to the same device")


def gatv2_attention(
    graph: Graph | Tensor,
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    edge_attr: Tensor | None = None,
    *,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    training: bool = False,
    aggregation: str = "auto",
    return_alpha: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Multi-head GATv2 attention ``out_i = sum_j alpha_ji x_l[j]`` (see the module docstring).

    Args:
        graph: a :class:`~fusegnn.sparse.Graph` (or an ``edge_index``); edges ``j -> i``;
            bipartite graphs are fine. On a worker's share of a distributed graph (a
            :class:`~fusegnn.sparse.halo.HaloGraph`) ``x_l`` and ``x_r`` hold the owned
            nodes' rows, and the halo rows of ``x_l`` are fetched first.
        x_l: ``[N_src, H, C]`` source features :math:`\Theta_s x_j` (also the messages).
        x_r: ``[N_dst, H, C]`` target features :math:`\Theta_t x_i`.
        att: ``[1, H, C]`` (or ``[H, C]``) attention vector :math:`a`.
        edge_attr: ``[E, H, C]`` projected edge features in the graph's edge order, or ``None``.
        negative_slope: LeakyReLU slope.
        dropout: probability of dropping a coefficient, in ``[0, 1)``; only when ``training``.
        training: apply dropout.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).
        return_alpha: also return the coefficients after dropout, ``[E, H]`` in the
            graph's edge order (runs the reference composition).

    Returns:
        ``out`` ``[N_dst, H, C]``, or ``(out, alpha)``; differentiable with respect to
        ``x_l``, ``x_r``, ``att`` and ``edge_attr``. Targets without incoming edges get zeros.
    """
    if not isinstance(x_l, Tensor):
        raise TypeError(f"x_l must be a torch.Tensor, got {type(x_l).__name__}")
    # a worker's share of a distributed graph: x_l holds the owned sources, their halo fetched
    graph, x_l = with_halo_rows(graph, x_l)
    graph = graph_arg(graph, x_l.size(0) if x_l.dim() > 0 else None)
    check_node_tensor(x_l, graph, graph.num_src_nodes, "x_l", (3,))
    H, C = x_l.size(1), x_l.size(2)
    check_node_tensor(x_r, graph, graph.num_dst_nodes, "x_r", (3,))
    _check_like(x_r, "x_r", (-1, H, C), x_l)
    _check_like(att, "att", (H, C) if isinstance(att, Tensor) and att.dim() == 2 else (1, H, C), x_l)
    if edge_attr is not None:
        _check_like(edge_attr, "edge_attr", (graph.num_edges, H, C), x_l)
    p = attention_options(negative_slope, dropout, training, return_alpha, aggregation)
    slope = float(negative_slope)
    if isinstance(graph, GraphRef):
        out, alpha = library.gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p, return_alpha, aggregation)
        return (out, alpha) if return_alpha else out

    backend = resolve_aggregation(aggregation, graph, x_l, x_r, op="gatv2")
    if backend.name != "reference" and return_alpha:
        note_path("reference", f"return_alpha is not fused: {backend.name} hands GATv2 to the reference")
    if backend.name == "reference" or return_alpha:
        out, alpha = reference.gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p)
        return (out, alpha) if return_alpha else out
    from fusegnn.kernels.gatv2_fused import fused_gatv2_attention

    return fused_gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p, aggregation=backend.name)
