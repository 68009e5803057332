r"""GraphSAGE (Hamilton, Ying & Leskovec, NeurIPS 2017), drop-in for PyG's ``SAGEConv``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers._utils import (
    aggregate_linear,
    channel_pair,
    check_reduce,
    input_linear,
    layer_inputs,
)
from fusegnn.sparse import Graph
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["SAGEConv"]


class SAGEConv(nn.Module):
    r"""The GraphSAGE operator.

    .. math::
        \mathbf{x}'_i = \mathbf{W}_1 \mathbf{x}_i + \mathbf{W}_2 \cdot
        \bigoplus_{j \in \mathcal{N}(i)} \mathbf{x}_j + \mathbf{b}

    with :math:`\bigoplus` the mean (default), sum or elementwise max over the incoming
    edges :math:`j \to i` (a target without any gets zeros), :math:`\mathbf{W}_1`
    ``lin_r`` (the root term, without bias; left out with ``root_weight=False`` or when
    the targets have no features, ``x = (x_src, None)``), :math:`\mathbf{W}_2`,
    :math:`\mathbf{b}` ``lin_l``. With ``project=True`` the sources are first projected,
    :math:`\mathbf{x}_j \leftarrow \mathrm{ReLU}(\mathbf{W}_3 \mathbf{x}_j + \mathbf{b}_3)`
    (``lin``); with ``normalize=True`` the output rows are scaled to unit
    :math:`\ell_2` norm. Parameter names and shapes are PyG's (``lin_l``, ``lin_r``,
    ``lin``), so state dicts load both ways; initialisation is PyG's ``Linear`` default
    (``nn.Linear``'s).

    For the mean and the sum, :math:`\mathbf{W}_2` commutes with the aggregation, so the
    layer aggregates at the narrower of the source and output widths (the bias is then the
    aggregation's epilogue; :func:`~fusegnn.layers._utils.project_before_aggregating`: not
    in an eager CUDA training step on a small graph whose input needs no gradient); the
    max aggregates the input features.

    Args:
        in_channels: input width, ``-1`` to infer it at the first forward (create the
            optimizer after that call), or a pair ``(in_src, in_dst)`` of source and
            target widths (bipartite inputs), either of which may be ``-1``.
        out_channels: output width.
        aggr: ``"mean"``, ``"sum"`` (or ``"add"``) or ``"max"``.
        normalize: :math:`\ell_2`-normalise the output rows.
        root_weight: add the transformed target features :math:`\mathbf{W}_1 \mathbf{x}_i`.
        project: project the source features first (not with a lazy ``in_channels``).
        bias: learn the additive bias of ``lin_l``.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, in_channels]`` or a pair ``(x_src [N_src, in_src], x_dst [N_dst, in_dst]
        or None)``; ``edge_index`` an ``edge_index`` ``[2, E]``, a
        :class:`~fusegnn.sparse.Graph` (``N_src x N_dst`` for a pair) or a ``torch.sparse``
        ``adj_t`` ``[N_dst, N_src]`` (rows are targets); ``size`` PyG's optional
        ``(N_src, N_dst)``, which gives the target count of ``(x_src, None)``
        (else a graph's own, or ``N_src`` for an ``edge_index``)
        -> ``[N_dst, out_channels]``.

    A graph's edge weights (a float ``adj_t``'s values, a weighted
    :class:`~fusegnn.sparse.Graph`'s ``edge_weight``) scale the messages,
    :math:`w_{ji} \mathbf{x}_j`, as PyG's sparse-matrix path does; an ``edge_index`` is
    unweighted.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        aggr: str = "mean",
        normalize: bool = False,
        root_weight: bool = True,
        project: bool = False,
        bias: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.aggr = aggr
        self.reduce = check_reduce(aggr, name)
        self.normalize = normalize
        self.root_weight = root_weight
        self.project = project
        self.aggregation = check_aggregation(aggregation)
        in_src, in_dst = channel_pair(in_channels, name)
        if project and in_src == -1:
            raise ValueError(f"{name} does not support lazy initialisation (in_channels=-1) with project=True")
        self.lin = input_linear(in_src, in_src, name, bias=True) if project else None
        self.lin_l = input_linear(in_src, out_channels, name, bias=bias)
        self.lin_r = input_linear(in_dst, out_channels, name) if root_weight else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.lin, self.lin_l, self.lin_r):
            if lin is not None:
                lin.reset_parameters()

    def forward(
        self, x: Tensor | tuple[Tensor, Tensor | None], edge_index: Graph | Tensor,
        size: tuple[int, int] | None = None,
    ) -> Tensor:
        x_src, x_dst, graph = layer_inputs(
            self, x, edge_index, size, lin_src=self.lin_l, lin_dst=self.lin_r
        )
        if self.lin is not None:
            x_src = F.relu(self.lin(x_src))
        out = aggregate_linear(graph, x_src, self.lin_l, self.reduce, self.aggregation)
        if self.lin_r is not None and x_dst is not None:
            out = out + self.lin_r(x_dst)
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}, aggregation={self.aggregation!r}"

