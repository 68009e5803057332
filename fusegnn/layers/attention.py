r"""Sparse multi-head attention and a transformer encoder layer on
:func:`fusegnn.attention.sparse_attention.sparse_attention`.

:class:`SparseMultiheadAttention` is :class:`torch.nn.MultiheadAttention` (same parameter
names, shapes and initialisation, so ``load_state_dict`` moves weights either way) with
the dense ``attn_mask`` replaced by a :class:`~fusegnn.attention.masks.Mask` or a
:class:`~fusegnn.attention.block_layout.BlockLayout`. For input :math:`X_q, X_k, X_v` with
``E = embed_dim``, ``H = num_heads``, ``D = E / H`` and head :math:`h`:

.. math::
    Q_h = X_q W^{(q)\top}_h + b^{(q)}_h, \quad K_h = X_k W^{(k)\top}_h + b^{(k)}_h, \quad
    V_h = X_v W^{(v)\top}_h + b^{(v)}_h

.. math::
    O_h = \operatorname{softmax}_{M}\!\Big(\frac{Q_h K_h^\top}{\sqrt{D}}\Big) V_h, \qquad
    \mathrm{out} = [O_1 \Vert \dots \Vert O_H]\, W^{(o)\top} + b^{(o)}

where :math:`\operatorname{softmax}_M` normalises each row over the keys the mask allows
(``M`` is per head or shared); a query with no allowed key gets :math:`O = 0` (where
``nn.MultiheadAttention`` would return NaN). ``mask=None`` is full attention (dense SDPA).

The mask's block layout is built once per (mask, block size, device) and cached on the
mask by ``sparse_attention``, so a layer called with the same mask every step builds it
once. On the CPU ``aggregation="auto"`` runs the dense reference; on CUDA the cheapest,
under the op's calibrated cost model, of PyTorch's dense SDPA (``is_causal=True`` for an
exactly causal mask, no mask for a full one, else the boolean mask -- e.g. at short
sequences, where the sparse kernels' fixed cost dominates) and the fused block-sparse
kernel (or the element-level path for very irregular masks); see
:func:`~fusegnn.attention.sparse_attention.explain_attention`.

``nm=(N, M)`` makes the attention dynamically N:M sparse (DFSS): of every ``M``
consecutive keys of a query only the ``N`` largest allowed scores enter the softmax
(:mod:`fusegnn.kernels.nm_sparsity`), computed by the fused block kernel on CUDA (the
dense reference on the CPU); with ``mask=None`` it applies to full attention (a full
mask, built once per ``(L_q, L_k)`` -- outside a ``torch.compile`` trace -- and shared by
every module).
"""

from __future__ import annotations

import operator
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.attention.block_layout import BlockLayout
from fusegnn.attention.masks import Mask, from_dense, sliding_window
from fusegnn.attention.sparse_attention import ATTENTION_AGGREGATIONS, check_nm, sparse_attention
from fusegnn.layers.vector_sparse_linear import VectorSparseLinear

__all__ = ["SparseMultiheadAttention", "SparseTransformerEncoderLayer"]

MaskLike = Union[Mask, BlockLayout, None]


def _check_mask_arg(mask: object, name: str = "mask") -> None:
    if mask is not None and not isinstance(mask, (Mask, BlockLayout)):
        raise TypeError(
            f"{name} must be None, a fusegnn.attention.masks.Mask or a BlockLayout, got {type(mask).__name__} "
            "(build one from a dense boolean tensor with fusegnn.attention.masks.from_dense; note that "
            "True means 'may attend', the opposite of nn.MultiheadAttention's boolean attn_mask)"
        )


#: the full masks (every key allowed) of N:M attention without a mask, by ``(L_q, L_k)``;
#: masks are immutable, so every module shares them (and their cached layouts)
_FULL_MASKS: dict[tuple[int, int], Mask] = {}


@torch.compiler.assume_constant_result
def _build_full_mask(L_q: int, L_k: int) -> int:
    """Put the full ``L_q x L_k`` mask into :data:`_FULL_MASKS` if it is not there; called
    by Dynamo instead of traced (it cannot trace a mask's construction, which registers a
    handle), so that the compiled code then reads the mask that exists."""
    if (L_q, L_k) not in _FULL_MASKS:
        full = sliding_window(L_q, L_q) if L_q == L_k else from_dense(torch.ones(L_q, L_k, dtype=torch.bool))
        _FULL_MASKS[(L_q, L_k)] = full
    return 0


def _full_mask(L_q: int, L_k: int) -> Mask:
    """Every key allowed (N:M attention without a mask), built once per ``(L_q, L_k)``,
    also under ``torch.compile(fullgraph=True)`` (where building it in the traced code
    failed; ``operator.index`` specialises symbolic lengths for the constant call)."""
    L_q, L_k = operator.index(L_q), operator.index(L_k)
    _build_full_mask(L_q, L_k)
    return _FULL_MASKS[(L_q, L_k)]


class SparseMultiheadAttention(nn.Module):
    r"""Multi-head attention restricted to a sparse mask (see the module docstring).

    Args:
        embed_dim: model width ``E``; queries, keys and values all have it.
        num_heads: ``H``; must divide ``embed_dim``.
        dropout: attention-weight dropout; only ``0.0`` is supported (the fused kernels
            never materialise the weights), anything else raises ``ValueError``.
        bias: add biases to the input and output projections.
        batch_first: inputs are ``[B, L, E]`` (default) rather than ``[L, B, E]``.
        aggregation: ``"auto"``, ``"block"``, ``"element"``, ``"reference"``,
            ``"dense"`` or ``"vector"`` (see
            :func:`~fusegnn.attention.sparse_attention.sparse_attention`).
        block_size: ``BM`` or ``(BM, BN)`` of the layout built from a ``Mask``
            (``W`` or ``(W, BLOCK_N)`` for ``"vector"``; ``None``: the op's default).
        nm: ``(N, M)`` in ``(1, 2)``, ``(2, 4)``, ``(4, 8)`` (or ``"N:M"``): N:M sparse
            attention (module docstring); ``None``: every allowed score.

    Parameters (as in ``nn.MultiheadAttention``): ``in_proj_weight`` ``[3E, E]``,
    ``in_proj_bias`` ``[3E]``, ``out_proj`` (``Linear(E, E)``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = True,
        aggregation: str = "auto",
        block_size: int | tuple[int, int] | None = None,
        device=None,
        dtype=None,
        nm: tuple[int, int] | str | None = None,
    ) -> None:
        super().__init__()
        self.nm = check_nm(nm)
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if dropout != 0.0:
            raise ValueError(
                f"dropout={dropout}: SparseMultiheadAttention supports only dropout=0.0 on the attention "
                "weights (the fused kernels never materialise them); use dropout on the output instead"
            )
        if aggregation not in ATTENTION_AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {ATTENTION_AGGREGATIONS}, got {aggregation!r}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = 0.0
        self.batch_first = batch_first
        self.aggregation = aggregation
        self.block_size = block_size
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.MultiheadAttention``'s initialisation: Xavier-uniform input projection,
        zero biases (the output projection keeps ``nn.Linear``'s weight init)."""
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: Tensor, index: int) -> Tensor:
        """``[B, L, E] -> [B, H, L, D]`` (a strided view; the kernels take strides)."""
        E = self.embed_dim
        w = self.in_proj_weight[index * E : (index + 1) * E]
        b = None if self.in_proj_bias is None else self.in_proj_bias[index * E : (index + 1) * E]
        y = F.linear(x, w, b)
        return y.view(x.size(0), x.size(1), self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: MaskLike = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, None]:
        """Attend ``query`` to ``key`` / ``value`` under ``mask``.

        Args:
            query: ``[B, L_q, E]`` (``[L_q, B, E]`` when ``batch_first=False``).
            key, value: ``[B, L_k, E]``.
            mask: a ``Mask`` / ``BlockLayout`` over ``L_q x L_k`` (``True`` = may attend),
                shared or with ``num_heads`` heads; ``None`` for full attention.
            need_weights: must be ``False`` (the weights are never materialised).

        Returns:
            ``(out, None)`` with ``out`` shaped like ``query``.
        """
        if need_weights:
            raise ValueError("need_weights=True is not supported: sparse attention never materialises the weights")
        _check_mask_arg(mask)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.size(-1) != self.embed_dim:
                layout = "[B, L, E]" if self.batch_first else "[L, B, E]"
                raise ValueError(f"{name} must be {layout} with E = {self.embed_dim}, got shape {tuple(t.shape)}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if key.shape[:2] != value.shape[:2] or key.size(0) != query.size(0):
            raise ValueError(
                f"query, key, value must share the batch size and key / value the length; got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} (batch first)"
            )
        q, k, v = self._project(query, 0), self._project(key, 1), self._project(value, 2)
        if mask is None and self.nm is None:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            if mask is None:
                mask = _full_mask(q.size(2), k.size(2))
            out = sparse_attention(q, k, v, mask, aggregation=self.aggregation, block_size=self.block_size,
                                   nm=self.nm)
        B, L_q = query.shape[:2]
        out = self.out_proj(out.transpose(1, 2).reshape(B, L_q, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def extra_repr(self) -> str:
        nm = f", nm={self.nm[0]}:{self.nm[1]}" if self.nm is not None else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
            f"aggregation={self.aggregation!r}{nm}"
        )


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class SparseTransformerEncoderLayer(nn.Module):
    r"""``nn.TransformerEncoderLayer`` with :class:`SparseMultiheadAttention` as its
    self-attention (same submodule names: ``self_attn``, ``linear1``, ``linear2``,
    ``norm1``, ``norm2``, ``dropout``, ``dropout1``, ``dropout2``).

    Post-norm (``norm_first=False``):

    .. math::
        x \leftarrow \mathrm{LN}_1\big(x + \mathrm{Drop}(\mathrm{SA}_M(x))\big), \qquad
        x \leftarrow \mathrm{LN}_2\big(x + \mathrm{Drop}(W_2\,\mathrm{Drop}(\sigma(W_1 x + b_1)) + b_2)\big)

    pre-norm (``norm_first=True``):
    :math:`x \leftarrow x + \mathrm{Drop}(\mathrm{SA}_M(\mathrm{LN}_1 x))`, then
    :math:`x \leftarrow x + \mathrm{Drop}(\mathrm{FF}(\mathrm{LN}_2 x))`.

    ``dropout`` applies to the residual branches and inside the feed-forward block, as in
    PyTorch; unlike PyTorch it does **not** drop attention weights (the fused kernels do
    not support it), so the layers agree exactly in eval mode or with ``dropout=0``.

    Args:
        d_model, nhead, dim_feedforward, dropout, activation (``"relu"``, ``"gelu"`` or a
            callable), layer_norm_eps, batch_first, norm_first, bias: as in
            ``nn.TransformerEncoderLayer`` (``batch_first`` defaults to ``True`` here).
        mask: default ``Mask`` / ``BlockLayout`` of the self-attention (``None``: full
            attention); ``forward(src, mask=...)`` overrides it.
        aggregation, block_size, nm: passed to :class:`SparseMultiheadAttention`.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = True,
        norm_first: bool = False,
        bias: bool = True,
        mask: MaskLike = None,
        aggregation: str = "auto",
        block_size: int | tuple[int, int] | None = None,
        device=None,
        dtype=None,
        nm: tuple[int, int] | str | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        _check_mask_arg(mask)
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
            activation = _ACTIVATIONS[activation]
        elif not callable(activation):
            raise TypeError(f"activation must be a string or a callable, got {type(activation).__name__}")
        self.self_attn = SparseMultiheadAttention(
            d_model, nhead, bias=bias, batch_first=batch_first, aggregation=aggregation,
            block_size=block_size, nm=nm, **factory,
        )
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = activation
        self.mask = mask

    def _sa_block(self, x: Tensor, mask: MaskLike) -> Tensor:
        return self.dropout1(self.self_attn(x, x, x, mask=mask)[0])

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, src: Tensor, mask: MaskLike = None) -> Tensor:
        """``src`` ``[B, L, E]`` (or ``[L, B, E]``); ``mask`` overrides the layer's mask."""
        _check_mask_arg(mask)
        mask = self.mask if mask is None else mask
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, mask))
            x = self.norm2(x + self._ff_block(x))
        return x

    def sparsify_feedforward(
        self, sparsity: float, V: int = 8, *, backend: str = "auto"
    ) -> "SparseTransformerEncoderLayer":
        r"""Make the feed-forward block vector-sparse, in place: ``linear1`` and ``linear2``
        (trained ``nn.Linear``) become :class:`~fusegnn.layers.VectorSparseLinear` through
        :meth:`~fusegnn.layers.VectorSparseLinear.from_linear` -- each weight
        magnitude-pruned to ``sparsity`` in ``V``-vectors, the kept vectors holding the
        trained values, the biases kept -- so that fine-tuning trains only the kept vectors.
        Returns the layer. The new parameters replace the old ones: an optimizer built
        before the call must be rebuilt."""
        for name in ("linear1", "linear2"):
            linear = getattr(self, name)
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{name} must be an nn.Linear to prune, got {type(linear).__name__} (pruned already?)")
            setattr(self, name, VectorSparseLinear.from_linear(linear, sparsity, V, backend=backend))
        return self
