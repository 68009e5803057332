r"""Graph attention (Velickovic et al., ICLR 2018), drop-in for PyG's ``GATConv``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusegnn.layers._attention_weights import attention_weights
from fusegnn.layers._utils import (
    bipartite_graph_for,
    check_attention_args,
    check_edge_features,
    check_features,
    check_linear_input,
    glorot_,
    graph_for,
    input_linear,
    node_pair,
)
from fusegnn.sparse import Graph, gat_attention, gat_layer
from fusegnn.sparse.attention_loops import attention_self_loop_edge_attr, attention_self_loops
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GATConv"]


class GATConv(nn.Module):
    r"""The graph attentional operator.

    For each head :math:`k` with weights :math:`\mathbf{\Theta}_k`, attention vectors
    :math:`\mathbf{a}^{(k)}_{s}, \mathbf{a}^{(k)}_{t}`:

    .. math::
        \mathbf{h}^{(k)}_j = \mathbf{\Theta}_k \mathbf{x}_j, \qquad
        e^{(k)}_{ji} = \mathrm{LeakyReLU}\left(\mathbf{a}^{(k)\top}_{s} \mathbf{h}^{(k)}_j
        + \mathbf{a}^{(k)\top}_{t} \mathbf{h}^{(k)}_i\right)

    .. math::
        \alpha^{(k)}_{ji} = \mathrm{softmax}_{j \in \mathcal{N}(i) \cup \{i\}}\big(e^{(k)}_{ji}\big),
        \qquad
        \mathbf{x}'_i = \big\Vert_{k=1}^{H} \sum_{j} \alpha^{(k)}_{ji} \mathbf{h}^{(k)}_j + \mathbf{b}

    (concatenation over heads, or their mean when ``concat=False``). With edge features
    (``edge_dim``) the score gains :math:`\mathbf{a}^{(k)\top}_{e} \mathbf{\Theta}_{e,k}
    \mathbf{e}_{ji}` inside the LeakyReLU; it is computed as
    :math:`\mathbf{e}_{ji} \cdot (\mathbf{\Theta}_{e,k}^\top \mathbf{a}^{(k)}_e)` (``[E, H]``,
    never ``[E, H, C]``) and added to the logits inside the fused kernels. A bipartite
    input ``(x_src, x_dst)`` scores targets with :math:`\mathbf{\Theta}_{dst}` (``lin_dst``,
    or the shared ``lin``); ``x_dst = None`` drops the target term. When
    ``in_channels < out_channels`` the layer aggregates the inputs and transforms after,
    :math:`\mathbf{\Theta}_k \sum_j \alpha^{(k)}_{ji} \mathbf{x}_j`, with the scores
    :math:`(\mathbf{\Theta}_k^\top \mathbf{a}^{(k)}_s)^\top \mathbf{x}_j`: the same function
    (up to rounding), fewer values per edge. This is the
    SDDMM -> edge softmax -> SpMM pipeline, run by :func:`~fusegnn.sparse.gat_attention`:
    on CUDA one fused kernel per pass (online softmax, nothing of size ``E`` stored), the
    reference composition ``sddmm(graph, a_s, a_t, "add")`` ->
    :func:`~fusegnn.sparse.edge_softmax` -> :func:`~fusegnn.sparse.spmm` otherwise.
    Attention dropout drops coefficients after the softmax.

    Args:
        in_channels: input feature width, or ``-1`` to infer it from ``x`` at the first
            forward (PyG's lazy initialisation: the weight is materialised and
            Glorot-initialised then; create the optimizer after that call); or a pair
            ``(in_src, in_dst)`` (either may be ``-1``) for separate source and target
            transforms ``lin_src`` / ``lin_dst`` (PyG's names; an int gives one shared
            ``lin``).
        out_channels: feature width of each head.
        heads: number of attention heads :math:`H`.
        concat: concatenate heads (``[N, H * out_channels]``) or average them
            (``[N, out_channels]``).
        negative_slope: LeakyReLU slope.
        dropout: dropout probability on the attention coefficients (training only).
        add_self_loops: replace existing self-loops by exactly one per node (on a
            bipartite graph: a loop from source ``i`` to target ``i`` for each
            ``i < min(N_src, N_dst)``, as PyG does).
        edge_dim: width of the edge features ``edge_attr`` (``None``: the layer takes
            none). Adds ``lin_edge`` (no bias) and ``att_edge`` ``[1, H, C]`` and the score
            term :math:`\mathbf{a}^{(k)\top}_{e} \mathbf{\Theta}_{e,k} \mathbf{e}_{ji}`.
        fill_value: the edge features of the self-loops the layer adds: a number, a
            feature tensor, or ``"add"`` / ``"sum"`` / ``"mean"`` / ``"min"`` / ``"max"`` /
            ``"mul"`` of each target's incoming edges' features (default ``"mean"``).
        bias: learn an additive bias.
        residual: add a bias-free linear transform ``res`` of the target features
            :math:`\mathbf{x}_i` to the output (PyG's ``residual``).
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``.

    The graph argument ``edge_index`` (PyG's name) is an ``edge_index`` ``[2, E]``, a
    :class:`~fusegnn.sparse.Graph`, a ``torch.sparse`` COO or CSR matrix in PyG's ``adj_t``
    orientation (rows are targets: ``adj_t[i, j] != 0`` is the edge ``j -> i``) or a
    networkx graph (nodes in ``G.nodes`` order); see
    :func:`~fusegnn.sparse.graph.coerce_graph`. Edge weights of any of them are ignored,
    as by PyG's ``GATConv`` (the attention computes its own). The sparse and networkx
    forms are converted eagerly only; under ``torch.compile`` pass the
    :class:`~fusegnn.sparse.Graph` built from them. ``x`` must have the layer's dtype
    (else a ``TypeError``).

    ``forward(x, edge_index, edge_attr=None, size=None, return_attention_weights=None)``
    (PyG's signature; ``x`` a tensor or a pair ``(x_src, x_dst)``, ``size`` an optional
    ``(N_src, N_dst)``; ``edge_attr`` ``[E, edge_dim]`` (or ``[E]`` for ``edge_dim=1``) in
    the order of the graph's edges) returns the new
    features, or with ``return_attention_weights=True`` the pair
    ``(out, (edge_index, alpha))`` where ``edge_index`` includes the self-loops the layer
    added and ``alpha`` is ``[E, H]``; for a ``torch.sparse`` input, as PyG,
    ``(out, (adj, alpha))`` with ``adj`` the processed ``[N_dst, N_src, H]`` sparse matrix
    (the input's layout) holding ``alpha``, which is in its row-major order
    (:func:`~fusegnn.layers._attention_weights.attention_weights`).

    Under ``torch.compile`` the same code runs on a graph reference: the attention is one
    ``fusegnn::gat_attention`` custom op and the self-loop processing runs inside it (:mod:`fusegnn.sparse.library`); with
    ``return_attention_weights`` and self-loops, the edge count of ``edge_index`` and
    ``alpha`` is then a size the compiler only learns at run time. Under compilation
    ``edge_index`` is a copy of the processed graph's. Self-loops with edge features, or
    on a bipartite graph, are added eagerly only (their edge order is data-dependent):
    under compilation pass a graph that has them and ``add_self_loops=False``.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: int | None = None,
        fill_value: float | Tensor | str = "mean",
        bias: bool = True,
        residual: bool = False,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_attention_args(name, heads, dropout, edge_dim)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.residual = residual
        self.aggregation = check_aggregation(aggregation)
        # PyG's names: one shared ``lin`` for an int in_channels, else ``lin_src`` / ``lin_dst``
        self.lin = self.lin_src = self.lin_dst = None
        if isinstance(in_channels, (tuple, list)):
            if len(in_channels) != 2:
                raise ValueError(f"{name}: in_channels must be an int or a pair (in_src, in_dst), got {in_channels!r}")
            self.in_channels = tuple(in_channels)
            self.lin_src = input_linear(in_channels[0], heads * out_channels, name)
            self.lin_dst = input_linear(in_channels[1], heads * out_channels, name)
        else:
            self.lin = input_linear(in_channels, heads * out_channels, name)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = nn.Linear(edge_dim, heads * out_channels, bias=False)
            self.att_edge = nn.Parameter(torch.empty(1, heads, out_channels))
        else:
            self.lin_edge = None
            self.register_parameter("att_edge", None)
        width = heads * out_channels if concat else out_channels
        if residual:
            in_dst = self.in_channels[1] if isinstance(self.in_channels, tuple) else self.in_channels
            self.res = input_linear(in_dst, width, name)
        else:
            self.register_parameter("res", None)
        self.bias = nn.Parameter(torch.empty(width)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.lin, self.lin_src, self.lin_dst, self.lin_edge, self.res):
            if lin is not None:
                glorot_(lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        glorot_(self.att_edge)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    # ------------------------------------------------------------------ inputs
    def _check_nodes(self, x, x_src: Tensor, x_dst: Tensor | None) -> None:
        """Check (and for a lazy layer, initialise from) the node features."""
        name = type(self).__name__
        if self.res is not None and x_dst is not None:
            # first, as PyG's forward (a lazy res is materialised before lin, Glorot-initialised)
            check_linear_input(x_dst, self.res, name, "x_dst" if not isinstance(x, Tensor) else "x")
        if self.lin is not None and isinstance(x, Tensor):
            check_features(x, self)  # the plain square input, as before
            return
        lin_src = self.lin if self.lin is not None else self.lin_src
        lin_dst = self.lin if self.lin is not None else self.lin_dst
        check_linear_input(x_src, lin_src, name, "x_src" if not isinstance(x, Tensor) else "x")
        if x_dst is not None:
            check_linear_input(x_dst, lin_dst, name, "x_dst" if not isinstance(x, Tensor) else "x")
        if self.lin is not None:
            self.in_channels = self.lin.in_features
        else:
            self.in_channels = (self.lin_src.in_features, self.lin_dst.in_features)

    def _graph(self, x, x_src: Tensor, x_dst: Tensor | None, edge_index, size) -> Graph:
        name = type(self).__name__
        if isinstance(x, Tensor) and size is None:
            return graph_for(x, edge_index, name)
        num_dst = x_dst.size(0) if x_dst is not None else None
        if size is not None:
            if not isinstance(size, (tuple, list)) or len(size) != 2:
                raise ValueError(f"{name}: size must be a pair (N_src, N_dst) or None, got {size!r}")
            if size[0] is not None and int(size[0]) != x_src.size(0):
                raise ValueError(f"{name}: size[0]={size[0]} but x_src has {x_src.size(0)} rows")
            if size[1] is not None:
                if num_dst is not None and int(size[1]) != num_dst:
                    raise ValueError(f"{name}: size[1]={size[1]} but x_dst has {num_dst} rows")
                num_dst = int(size[1])
        return bipartite_graph_for(x_src, num_dst, edge_index, name)

    def _score_edge(self, graph: Graph, edge_attr: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        r"""The per-edge, per-head score term ``[E, H]`` in the processed graph's edge
        order: :math:`\mathbf{e}_{ji} \cdot (\mathbf{\Theta}_{e,k}^\top \mathbf{a}^{(k)}_e)`,
        with the self-loops' features from ``fill_value`` when the layer adds loops."""
        name = type(self).__name__
        if edge_attr is None:
            return None
        if self.lin_edge is None:
            raise ValueError(f"{name}: edge_attr was given but the layer was built without edge_dim")
        if isinstance(edge_attr, Tensor) and edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        check_edge_features(edge_attr, self.lin_edge, graph, name)
        if self.add_self_loops:
            edge_attr = attention_self_loop_edge_attr(graph, edge_attr, self.fill_value)
        H, C = self.heads, self.out_channels
        weight = self.lin_edge.weight.view(H, C, -1)
        return edge_attr @ (weight * self.att_edge.view(H, C, 1)).sum(dim=1).t().to(dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor | tuple[Tensor, Tensor | None],
        edge_index: Graph | Tensor,
        edge_attr: Tensor | None = None,
        size: tuple[int, int] | None = None,
        return_attention_weights: bool | None = None,
    ):
        x_src, x_dst = node_pair(x, type(self).__name__)
        self._check_nodes(x, x_src, x_dst)
        graph = self._graph(x, x_src, x_dst, edge_index, size)
        # the edge term is checked against the input graph, then follows its processing
        score_edge = self._score_edge(graph, edge_attr, x_src.dtype)
        if self.add_self_loops:
            # A pure function of the (immutable) structure, cached on the graph, so layers
            # that share a Graph process (and convert) it once.
            graph = attention_self_loops(graph)
        res = self.res(x_dst) if self.res is not None and x_dst is not None else None
        H, C = self.heads, self.out_channels
        if isinstance(x, Tensor) and self.lin is not None:
            out, alpha = self._attend_square(x, graph, score_edge, return_attention_weights)
        else:
            out, alpha = self._attend_pair(x_src, x_dst, graph, score_edge, return_attention_weights)
        if out.dim() == 3:  # [N, H, C] from the general path: the head epilogue and bias
            out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
            if self.bias is not None:
                out = out + self.bias
        if res is not None:
            out = out + res
        if return_attention_weights:
            return out, attention_weights(edge_index, graph, alpha)
        return out

    def head_inputs(self, x: Tensor, edge_index: Graph | Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        r"""The layer's output as a linear map of attention-aggregated inputs, ``(a, W', b)``
        with ``forward(x) == a @ W'.T + b``: for an output layer (``concat=False`` or one
        head), :math:`a_i = [\sum_j \alpha^h_{ji} x_j]_h` (heads side by side, scores from
        :math:`(\Theta_h^\top a) \cdot x`) and :math:`W' = [\Theta_h / H]_h`, what a fused
        classification loss (:func:`fusegnn.losses.linear_cross_entropy`) takes so that the
        logits are never written. Plain inputs only: one tensor ``x`` (no pair), no edge
        features, no residual (``ValueError`` otherwise). Dropout on the coefficients as in
        :meth:`forward`."""
        name = type(self).__name__
        if not isinstance(x, Tensor) or self.lin is None or self.res is not None or self.edge_dim is not None:
            raise ValueError(f"{name}.head_inputs takes one tensor x and a layer without residual or edge_dim")
        if self.concat and self.heads > 1:
            raise ValueError(f"{name}.head_inputs needs an output layer (concat=False or heads=1)")
        check_features(x, self)
        graph = self._graph(x, x, x, edge_index, None)
        if self.add_self_loops:
            graph = attention_self_loops(graph)
        H, C = self.heads, self.out_channels
        weight = self.lin.weight.view(H, C, self.in_channels)
        score_src = x @ (weight * self.att_src.view(H, C, 1)).sum(dim=1).t()  # [N, H]
        score_dst = x @ (weight * self.att_dst.view(H, C, 1)).sum(dim=1).t()
        values = x.unsqueeze(1).expand(-1, H, -1)  # [N, H, in]
        out, _ = self._attention(graph, values, score_src, score_dst, None, False)
        head_weight = weight.permute(1, 0, 2).reshape(C, H * self.in_channels) / H
        return out.reshape(out.size(0), H * self.in_channels), head_weight, self.bias

    def _attend_square(self, x: Tensor, graph: Graph, score_edge: Tensor | None, return_alpha):
        """One node set and the shared ``lin``: ``(out, alpha or None)``; ``out`` is the
        layer's output (bias included) on the common path, else ``[N, H, C]``."""
        H, C = self.heads, self.out_channels
        # Aggregate the narrower of x and h = x W^T: sum_j w_ji (W x_j) = W (sum_j w_ji x_j),
        # and the scores a . (W x) = (W^T a) . x. For GAT's output layer (16 -> 41
        # classes) the sparse pass then moves 16 instead of 41 values per edge.
        aggregate_first = self.in_channels < C
        if not aggregate_first and not return_alpha:
            # the common case: the sparse part is one op (one autograd node on the GPU)
            h = self.lin(x).view(-1, H, C)
            return gat_layer(  # the attention vectors in h's dtype: half under autocast, as h
                graph, h, self.att_src.to(h.dtype), self.att_dst.to(h.dtype), self.bias,
                concat=self.concat, negative_slope=self.negative_slope, dropout=self.dropout,
                training=self.training, aggregation=self.aggregation, score_edge=_as_dtype(score_edge, h.dtype),
            ), None
        if aggregate_first:
            weight = self.lin.weight.view(H, C, self.in_channels)
            score_src = self._score_dtype(x @ (weight * self.att_src.view(H, C, 1)).sum(dim=1).t())  # [N, H]
            score_dst = self._score_dtype(x @ (weight * self.att_dst.view(H, C, 1)).sum(dim=1).t())  # [N, H]
            values = x.unsqueeze(1).expand(-1, H, -1)  # [N, H, in]
        else:
            values = self.lin(x).view(-1, H, C)
            score_src = (values * self.att_src).sum(dim=-1)  # [N, H]
            score_dst = (values * self.att_dst).sum(dim=-1)  # [N, H]
        out, alpha = self._attention(graph, values, score_src, score_dst, score_edge, return_alpha)
        if aggregate_first:  # [N, H, in] -> [N, H, C]
            out = torch.einsum("nhf,hcf->nhc", out, weight)
        return out, alpha

    def _attend_pair(self, x_src: Tensor, x_dst: Tensor | None, graph: Graph, score_edge, return_alpha):
        r"""Separate source and target features (or transforms): ``(out [N_dst, H, C],
        alpha or None)``. Target scores :math:`(\Theta_{dst}^\top a_t) \cdot x_i` need no
        transformed target features; ``x_dst`` ``None`` scores sources (and edges) only."""
        H, C = self.heads, self.out_channels
        lin_src = self.lin if self.lin is not None else self.lin_src
        lin_dst = self.lin if self.lin is not None else self.lin_dst
        w_src = lin_src.weight.view(H, C, -1)
        aggregate_first = lin_src.in_features < C
        if aggregate_first:
            score_src = self._score_dtype(x_src @ (w_src * self.att_src.view(H, C, 1)).sum(dim=1).t())
            values = x_src.unsqueeze(1).expand(-1, H, -1)
        else:
            values = lin_src(x_src).view(-1, H, C)
            score_src = (values * self.att_src).sum(dim=-1)
        if x_dst is not None:
            weight_dst = lin_dst.weight.view(H, C, -1)
            score_dst = self._score_dtype(x_dst @ (weight_dst * self.att_dst.view(H, C, 1)).sum(dim=1).t())
        else:
            score_dst = score_src.new_zeros((graph.num_dst_nodes, H))
        out, alpha = self._attention(graph, values, score_src, score_dst, score_edge, return_alpha)
        if aggregate_first:
            out = torch.einsum("nhf,hcf->nhc", out, w_src)
        return out, alpha

    def _score_dtype(self, scores: Tensor) -> Tensor:
        r"""Scores formed as :math:`(\Theta^\top a) \cdot x` in the dtype of :math:`a \cdot
        (\Theta x)`: under ``torch.autocast`` the GEMM gives half, the float32 attention
        vector's product float32 (the other order's, and PyG's, scores and coefficients)."""
        dtype = torch.promote_types(scores.dtype, self.att_src.dtype)
        return scores if scores.dtype == dtype else scores.to(dtype)

    def _attention(self, graph, values, score_src, score_dst, score_edge, return_alpha):
        result = gat_attention(
            graph,
            values,
            score_src,
            score_dst,
            negative_slope=self.negative_slope,
            dropout=self.dropout,
            training=self.training,
            aggregation=self.aggregation,
            return_alpha=bool(return_alpha),
            score_edge=_as_dtype(score_edge, score_src.dtype),  # a GEMM's: half under autocast
        )
        # out [N_dst, H, C]; alpha [E, H], the coefficients after dropout
        return result if return_alpha else (result, None)

    def extra_repr(self) -> str:
        edge = f", edge_dim={self.edge_dim}" if self.edge_dim is not None else ""
        return (
            f"{self.in_channels}, {self.out_channels}, heads={self.heads}{edge}, "
            f"aggregation={self.aggregation!r}"
        )


def _as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype`` (``None`` stays ``None``)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)
