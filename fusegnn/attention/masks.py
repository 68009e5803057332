r"""Attention masks: exact predicates over (query, key) index pairs.

A :class:`Mask` says which keys each query may attend to in an ``L_q x L_k`` attention
matrix. Every mask is an **exact predicate** ``allowed(q, k)`` over integer indices
``0 <= q < L_q``, ``0 <= k < L_k``; everything else is derived from it and must agree
with it:

* ``mask.dense()`` -- the ``[L_q, L_k]`` boolean matrix (reference; small ``L`` only);
* ``mask.block_map(BM, BN)`` -- ``int8 [nrb, ncb]`` with ``nrb = ceil(L_q / BM)``,
  ``ncb = ceil(L_k / BN)`` and codes :data:`EMPTY` (0), :data:`PARTIAL` (1),
  :data:`FULL` (2), computed analytically per block for the structured masks (never
  materialising ``L_q x L_k``);
* ``mask.block_elements(rb, cb, BM, BN)`` -- the ``[BM, BN]`` element pattern of one block;
* ``mask.mask_mod`` -- the same predicate as a FlexAttention ``mask_mod``;
* ``mask.to_graph()`` -- the allowed pairs as a :class:`~fusegnn.sparse.Graph` with
  edges ``k -> q`` (source = key, target = query), ``num_nodes=(L_k, L_q)``, edges sorted
  by query then key, for the element-level attention path (``sddmm`` -> ``edge_softmax``
  -> ``spmm``, the ops GAT runs on).

**Block codes and the ragged edge.** Block ``(rb, cb)`` at ``BM x BN`` covers queries
``[rb*BM, min((rb+1)*BM, L_q))`` and keys ``[cb*BN, min((cb+1)*BN, L_k))``; rows and
columns beyond ``L`` (the padding of the last block row / column when ``L`` is not a
multiple of the block) do not count. A block is

* ``EMPTY`` (0) when no in-range element is allowed,
* ``FULL`` (2) when **every in-range element** is allowed (so a ragged edge block can be
  full: a kernel must mask out-of-range rows and keys by ``L`` anyway, and needs no
  element mask for it),
* ``PARTIAL`` (1) otherwise; its element pattern (``block_elements``) is ``False`` at
  padded rows and columns.

**Per-head masks.** A mask has ``num_heads``: 1 for a mask shared by every head, ``H``
for per-head masks (:func:`stack_heads`, or :func:`from_dense` of an ``[H, L_q, L_k]``
tensor). For a per-head mask ``dense()`` is ``[H, L_q, L_k]``, ``block_map`` is
``[H, nrb, ncb]``, ``block_elements`` and ``allowed`` take ``head``, and ``to_graph()``
stacks the heads (see :meth:`Mask.to_graph`).

**Combining.** ``a | b`` (union: allowed in either) and ``a & b`` (intersection: allowed
in both) of masks of the same ``L_q x L_k`` and compatible heads (equal, or one shared).
Their block maps are derived from the parts' maps -- a union with a full part is full,
an intersection with an empty part is empty, a single partial part combined with
empty (union) or full (intersection) parts stays partial -- and only blocks where two
or more parts are partial are re-evaluated element by element (a union of partial
blocks can be full, an intersection of partial blocks can be empty).

Constructors (each docstring gives the exact definition; ``q`` a query, ``k`` a key
index): :func:`causal`, :func:`sliding_window`, :func:`dilated`, :func:`global_tokens`,
:func:`random_blocks`, :func:`longformer`, :func:`bigbird`, :func:`from_dense`,
:func:`from_graph`, :func:`stack_heads`.

Masks are immutable; tensors a mask holds (a dense matrix, a random block table, a
graph's keys) live on the CPU and are copied to another device on first use there
(cached). Derived results (graphs, block layouts) can be cached on a mask with
:meth:`Mask.cached`.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from fusegnn.attention import handles
from fusegnn.sparse.graph import Graph, outside_inference_mode

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Mask",
    "causal",
    "sliding_window",
    "dilated",
    "global_tokens",
    "random_blocks",
    "longformer",
    "bigbird",
    "from_dense",
    "from_graph",
    "stack_heads",
]

EMPTY, PARTIAL, FULL = 0, 1, 2

# Elements evaluated at once when a block map or a graph is derived from elements.
_CHUNK_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------- helpers
def _check_int(value: Any, name: str, minimum: int | None = None) -> int:
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _block_bounds(L: int, B: int, nb: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """First and last in-range index of each of the ``nb`` blocks of size ``B`` over ``L``."""
    first = torch.arange(nb, device=device, dtype=torch.int64) * B
    last = torch.clamp(first + B, max=L) - 1
    return first, last


def _classify(count: Tensor, in_range: Tensor) -> Tensor:
    """Block codes from allowed-element counts and in-range element counts."""
    code = torch.full_like(count, PARTIAL, dtype=torch.int8)
    code[count == 0] = EMPTY
    code[count == in_range] = FULL
    return code


def _codes(empty: Tensor, full: Tensor) -> Tensor:
    code = torch.full(empty.shape, PARTIAL, dtype=torch.int8, device=empty.device)
    code[empty] = EMPTY
    code[full & ~empty] = FULL
    return code


def _check_block_size(BM: Any, BN: Any) -> tuple[int, int]:
    BM = _check_int(BM, "BM", 1)
    BN = _check_int(BN, "BN", 1)
    return BM, BN


def _floor_div(a: Tensor, b: int) -> Tensor:
    return torch.div(a, b, rounding_mode="floor")


class _DeviceBuffer:
    """A CPU tensor with cached copies on other devices."""

    def __init__(self, tensor: Tensor) -> None:
        self._copies = {tensor.device: tensor}
        self.cpu = tensor

    def on(self, device: torch.device) -> Tensor:
        copy = self._copies.get(device)
        if copy is None:
            copy = outside_inference_mode(lambda: self.cpu.to(device))
            self._copies[device] = copy
        return copy


# ----------------------------------------------------------------------------- base class
class Mask(handles.Handled):
    """An attention mask over ``L_q`` queries and ``L_k`` keys (see the module docstring).
    A copy (``deepcopy``, ``pickle``, a saved model holding it) has a handle of its own and
    empty caches, rebuilt on use.

    Subclasses implement :meth:`_allowed` (the exact predicate) and, where they can do it
    analytically, :meth:`_block_map` (otherwise it is derived from the elements).

    Attributes:
        L_q: number of queries (rows).
        L_k: number of keys (columns).
        num_heads: 1 for a mask shared by all heads, else the number of heads.
    """

    L_q: int
    L_k: int
    num_heads: int = 1
    _graph_block_size = (64, 64)  # blocks to_graph walks the mask in
    _DERIVED = {"_cache": dict}

    def __init__(self, L_q: int, L_k: int, num_heads: int = 1) -> None:
        self.L_q = _check_int(L_q, "L_q", 1)
        self.L_k = _check_int(L_k, "L_k", 1)
        self.num_heads = _check_int(num_heads, "num_heads", 1)
        self._cache: dict[Any, Any] = {}
        self.handle = handles.register(self)  # what compiled code passes to the custom ops

    # ------------------------------------------------------------------ to implement
    def _allowed(self, q: Tensor, k: Tensor, h: Tensor | None) -> Tensor:
        """Predicate on broadcastable in-range integer index tensors; ``h`` the head
        index tensor (``None`` allowed only for shared masks)."""
        raise NotImplementedError

    def _block_map(self, BM: int, BN: int, device: torch.device) -> Tensor:
        """``int8 [num_heads, nrb, ncb]`` block codes. Default: counted from elements."""
        return self._block_map_from_elements(BM, BN, device)

    def _params(self) -> str:
        return ""

    def _on_residues(self, d: int) -> "Mask | None":
        """The mask restricted to pairs with ``q = k (mod d)``, on sub-sequence positions
        ``(q // d, k // d)``, when it is the same on every residue (see
        :meth:`dilation_split`); ``None`` when it is not or is not known."""
        return None

    # ------------------------------------------------------------------ public API
    @property
    def shape(self) -> tuple[int, int]:
        """``(L_q, L_k)``."""
        return (self.L_q, self.L_k)

    @property
    def is_per_head(self) -> bool:
        return self.num_heads > 1

    def __repr__(self) -> str:
        params = self._params()
        heads = f", num_heads={self.num_heads}" if self.num_heads > 1 else ""
        return f"{type(self).__name__}(L_q={self.L_q}, L_k={self.L_k}{', ' + params if params else ''}{heads})"

    def num_blocks(self, BM: int, BN: int) -> tuple[int, int]:
        """``(nrb, ncb) = (ceil(L_q / BM), ceil(L_k / BN))``."""
        BM, BN = _check_block_size(BM, BN)
        return math.ceil(self.L_q / BM), math.ceil(self.L_k / BN)

    def allowed(self, q_idx: Tensor, k_idx: Tensor, head: int | Tensor | None = None) -> Tensor:
        """Whether query ``q_idx`` may attend to key ``k_idx`` (broadcasting integer
        tensors of in-range indices). ``head`` is required for a per-head mask."""
        for name, idx, bound in (("q_idx", q_idx, self.L_q), ("k_idx", k_idx, self.L_k)):
            if not isinstance(idx, Tensor) or idx.is_floating_point() or idx.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
                raise IndexError(f"{name} must lie in [0, {bound})")
        h = self._head_tensor(head, q_idx.device)
        return self._allowed(q_idx.long(), k_idx.long(), h)

    def dense(self, device: torch.device | str | None = None) -> Tensor:
        """The mask as a boolean ``[L_q, L_k]`` matrix (``[H, L_q, L_k]`` per head).

        Entry ``[q, k]`` is ``True`` iff query ``q`` may attend to key ``k``. Meant for
        references and small ``L``: it materialises ``L_q x L_k`` booleans.
        """
        device = _device(device)
        q = torch.arange(self.L_q, device=device).unsqueeze(1)
        k = torch.arange(self.L_k, device=device).unsqueeze(0)
        if self.num_heads == 1:
            return self._allowed(q, k, None).expand(self.L_q, self.L_k).clone()
        h = torch.arange(self.num_heads, device=device).view(-1, 1, 1)
        return self._allowed(q, k, h).expand(self.num_heads, self.L_q, self.L_k).clone()

    def block_map(self, BM: int, BN: int, device: torch.device | str | None = None) -> Tensor:
        """``int8 [nrb, ncb]`` (``[H, nrb, ncb]`` per head) block codes at ``BM x BN``:
        :data:`EMPTY` = 0, :data:`PARTIAL` = 1, :data:`FULL` = 2 (a full block has every
        in-range element allowed; see the module docstring for the ragged edge)."""
        BM, BN = _check_block_size(BM, BN)
        bmap = self._block_map3(BM, BN, _device(device)).clone()  # not the cached map itself
        return bmap[0] if self.num_heads == 1 else bmap

    def block_elements(
        self, rb: int, cb: int, BM: int, BN: int, head: int | None = None
    ) -> Tensor:
        """``bool [BM, BN]`` pattern of block ``(rb, cb)``: entry ``[i, j]`` is
        ``allowed(rb*BM + i, cb*BN + j)``, ``False`` where the row or column lies beyond
        ``L_q`` / ``L_k``. ``head`` is required for a per-head mask."""
        BM, BN = _check_block_size(BM, BN)
        nrb, ncb = self.num_blocks(BM, BN)
        rb = _check_int(rb, "rb", 0)
        cb = _check_int(cb, "cb", 0)
        if rb >= nrb or cb >= ncb:
            raise IndexError(f"block ({rb}, {cb}) is outside the {nrb} x {ncb} block grid")
        h = self._head_index(head)
        one = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        return self._elements(one(h), one(rb), one(cb), BM, BN, torch.device("cpu"))[0]

    @property
    def mask_mod(self) -> Callable[[Any, Any, Tensor, Tensor], Tensor]:
        """The predicate as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``
        (for ``torch.nn.attention.flex_attention.create_block_mask``). The batch index is
        ignored; the head index selects the head of a per-head mask.

        The indices are used as given: FlexAttention passes in-range ones (its kernels take
        them modulo the length when a length is not a multiple of the block). Clamping them
        here, as this method once did for the masks that read a table, made compiled
        FlexAttention 8x slower on a 1 %-dense ``from_dense`` mask (H200, L = 4096).
        A :func:`from_graph` mask's predicate is a ``searchsorted``, which compiled
        FlexAttention cannot lower: give it ``from_dense(mask.dense())`` instead."""
        per_head = self.num_heads > 1

        def mask_mod(b: Any, h: Any, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            head = h if per_head else None
            if per_head and not isinstance(head, Tensor):
                head = torch.as_tensor(head, device=q_idx.device)
            return self._allowed(q_idx, kv_idx, head)

        return mask_mod

    def to_graph(
        self, head: int | None = None, device: torch.device | str | None = None
    ) -> Graph:
        """The allowed pairs as a graph with edges ``k -> q`` (source = key, target =
        query), ``num_nodes=(L_k, L_q)``, edges sorted by query then key (so the CSR by
        target is the COO order itself), ``int64`` ids.

        For a per-head mask, ``head=h`` gives head ``h``'s graph; ``head=None`` gives all
        heads in one block-diagonal graph: key ``k`` of head ``h`` is node
        ``h * L_k + k``, query ``q`` of head ``h`` is node ``h * L_q + q``,
        ``num_nodes=(H * L_k, H * L_q)``. Built block by block (never ``L_q x L_k`` at
        once) and cached per (head, device).
        """
        device = _device(device)
        if head is not None:
            head = self._head_index(head)
        key = ("graph", head, device)
        if key not in self._cache:
            self._cache[key] = outside_inference_mode(lambda: self._build_graph(head, device))
        return self._cache[key]

    def dilation_split(self) -> "tuple[int, Mask] | None":
        r"""``(d, base)`` with ``d >= 2`` when the mask only connects tokens a multiple
        of ``d`` apart and is the same mask ``base`` on each of the ``d`` interleaved
        sub-sequences (token ``t`` is position ``t // d`` of sub-sequence ``t % d``):

        .. math:: \mathrm{allowed}(q, k) = [\, q \equiv k \pmod d \,] \wedge
            \mathrm{base.allowed}(\lfloor q/d \rfloor, \lfloor k/d \rfloor)

        with ``base`` over ``ceil(L_q / d) x ceil(L_k / d)`` (a shorter sub-sequence uses
        its first positions). :func:`dilated` masks split so (``base`` is the sliding
        window), and so do their intersections with :func:`causal` and
        :func:`sliding_window` masks. The block path of
        :func:`~fusegnn.attention.sparse_attention.sparse_attention` then runs ``base``'s
        layout over the sub-sequences (``block_sparse_attention(..., dilation=d)``):
        mostly full blocks instead of every block partial. ``None`` when the mask does
        not split. Cached."""
        return self.cached(("dilation_split",), self._dilation_split)

    def _dilation_split(self) -> "tuple[int, Mask] | None":
        return None

    def cached(self, key: Any, compute: Callable[[], Any], *, keep: bool = True) -> Any:
        """``compute()`` cached on this (immutable) mask under ``key``. With ``keep=False`` a
        value not cached yet is computed and returned without being stored (for a caller
        that stores it only if it uses it: ``cached(key, lambda: value)`` later)."""
        key = ("user", key)
        if key in self._cache:
            return self._cache[key]
        value = outside_inference_mode(compute)
        if keep:
            self._cache[key] = value
        return value

    def structure(
        self, device: torch.device | str | None = None, block_size: tuple[int, int] = (64, 64)
    ) -> str:
        r"""What dense attention kernels can exploit about this mask (every head):

        * ``"full"`` -- every ``(q, k)`` is allowed (no mask needed);
        * ``"causal"`` -- ``L_q == L_k >= 2`` and :math:`\mathrm{allowed}(q, k) = [k \le q]`
          exactly (SDPA's ``is_causal=True``);
        * ``"general"`` -- anything else (a causal mask restricted to a window, a causal
          mask with an emptied row, ... are general).

        Decided from the definition, never by materialising ``L_q x L_k``: the block map
        at ``block_size`` (analytic for the structured masks) must be all :data:`FULL`
        (``"full"``), or equal to the causal block map -- full below the diagonal, empty
        above -- with the element patterns of the partial blocks only (those crossing the
        diagonal, about ``L / BM`` of them) equal to the causal ones. A
        :func:`causal` mask answers at once. ``block_size`` changes only the work, not the
        answer (pass the block size a layout uses, so its cached block map is reused).
        Cached per device.
        """
        BM, BN = _check_block_size(*block_size)
        device = _device(device)
        key = ("structure", device)
        if key not in self._cache:
            self._cache[key] = outside_inference_mode(lambda: self._structure(BM, BN, device))
        return self._cache[key]

    def _structure(self, BM: int, BN: int, device: torch.device) -> str:
        bmap = self._block_map3(BM, BN, device)  # [H, nrb, ncb]
        if bool((bmap == FULL).all()):
            return "full"
        if self.L_q != self.L_k:
            return "general"
        ref = Causal(self.L_q)
        want = ref._block_map3(BM, BN, device)  # [1, nrb, ncb]
        if not torch.equal(bmap, want.expand_as(bmap)):
            return "general"
        h, rb, cb = (bmap == PARTIAL).nonzero(as_tuple=True)
        step = max(1, _CHUNK_ELEMENTS // (BM * BN))
        for s in range(0, rb.numel(), step):
            sl = slice(s, s + step)
            patterns, pid = self._patterns(h[sl], rb[sl], cb[sl], BM, BN, device)
            mine = patterns[pid]
            theirs = ref._elements(torch.zeros_like(rb[sl]), rb[sl], cb[sl], BM, BN, device)
            if not torch.equal(mine, theirs):
                return "general"
        return "causal"

    def __or__(self, other: "Mask") -> "Mask":
        return CombinedMask.make("union", self, other)

    def __and__(self, other: "Mask") -> "Mask":
        return CombinedMask.make("intersection", self, other)

    # ------------------------------------------------------------------ internals
    def _head_index(self, head: int | None) -> int:
        if self.num_heads == 1:
            if head is not None and _check_int(head, "head", 0) != 0:
                raise IndexError(f"head {head} given for a shared (single-head) mask")
            return 0
        if head is None:
            raise ValueError(f"this mask has {self.num_heads} heads: pass head=")
        head = _check_int(head, "head", 0)
        if head >= self.num_heads:
            raise IndexError(f"head {head} out of range for a mask with {self.num_heads} heads")
        return head

    def _head_tensor(self, head: int | Tensor | None, device: torch.device) -> Tensor | None:
        if self.num_heads == 1:
            if not isinstance(head, Tensor):
                self._head_index(head)  # None or 0
            return None
        if head is None:
            raise ValueError(f"this mask has {self.num_heads} heads: pass head=")
        if isinstance(head, Tensor):
            if head.is_floating_point() or head.is_complex() or head.dtype == torch.bool:
                raise TypeError(f"head must be an integer tensor, got dtype {head.dtype}")
            if head.numel() and (int(head.min()) < 0 or int(head.max()) >= self.num_heads):
                raise IndexError(f"head must lie in [0, {self.num_heads})")
            return head.long().to(device)
        return torch.tensor(self._head_index(head), device=device)

    def _block_map3(self, BM: int, BN: int, device: torch.device) -> Tensor:
        key = ("block_map", BM, BN, device)
        if key not in self._cache:
            bmap = outside_inference_mode(lambda: self._block_map(BM, BN, device))
            nrb, ncb = self.num_blocks(BM, BN)
            assert bmap.shape == (self.num_heads, nrb, ncb), bmap.shape
            self._cache[key] = bmap
        return self._cache[key]

    def _elements(
        self, h: Tensor, rb: Tensor, cb: Tensor, BM: int, BN: int, device: torch.device
    ) -> Tensor:
        """``bool [n, BM, BN]`` element patterns of blocks ``(h[i], rb[i], cb[i])``
        (padding ``False``), evaluated element by element. Subclasses may override with
        something faster."""
        q, k, in_range = _block_indices(rb, cb, BM, BN, self.L_q, self.L_k, device)
        hh = h.to(device).view(-1, 1, 1) if self.num_heads > 1 else None
        return self._allowed(q, k, hh) & in_range

    def _elements_chunked(
        self, h: Tensor, rb: Tensor, cb: Tensor, BM: int, BN: int, device: torch.device
    ) -> Tensor:
        out = torch.empty((rb.numel(), BM, BN), dtype=torch.bool, device=device)
        step = max(1, _CHUNK_ELEMENTS // (BM * BN))
        for s in range(0, rb.numel(), step):
            out[s : s + step] = self._elements(h[s : s + step], rb[s : s + step], cb[s : s + step], BM, BN, device)
        return out

    def _pattern_key(self, h: Tensor, rb: Tensor, cb: Tensor, BM: int, BN: int) -> Tensor | None:
        """``int64 [n, K]`` keys such that blocks with equal keys have equal element
        patterns, or ``None`` when the mask knows no such key."""
        return None

    def _patterns(
        self, h: Tensor, rb: Tensor, cb: Tensor, BM: int, BN: int, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """Element patterns of blocks ``(h[i], rb[i], cb[i])`` as ``(patterns [P, BM, BN],
        pid [n])`` with block ``i``'s pattern ``patterns[pid[i]]``. Blocks with equal
        :meth:`_pattern_key` share one evaluated pattern; ``patterns`` may still hold
        duplicates (callers dedupe by content)."""
        h, rb, cb = (t.to(device=device, dtype=torch.int64) for t in (h, rb, cb))
        key = self._pattern_key(h, rb, cb, BM, BN)
        if key is None:
            pid = torch.arange(rb.numel(), device=device)
            return self._elements_chunked(h, rb, cb, BM, BN, device), pid
        _, pid, first = _unique_rows(key)
        return self._elements_chunked(h[first], rb[first], cb[first], BM, BN, device), pid

    def _count_elements(
        self, h: Tensor, rb: Tensor, cb: Tensor, BM: int, BN: int, device: torch.device
    ) -> Tensor:
        """Allowed-element count of each block ``(h[i], rb[i], cb[i])`` (in chunks)."""
        counts = torch.empty(rb.numel(), dtype=torch.int64, device=device)
        step = max(1, _CHUNK_ELEMENTS // (BM * BN))
        for s in range(0, rb.numel(), step):
            sl = slice(s, s + step)
            patterns, pid = self._patterns(h[sl], rb[sl], cb[sl], BM, BN, device)
            counts[sl] = patterns.sum(dim=(1, 2))[pid]
        return counts

    def _block_map_from_elements(self, BM: int, BN: int, device: torch.device) -> Tensor:
        nrb, ncb = self.num_blocks(BM, BN)
        h, rb, cb = _all_blocks(self.num_heads, nrb, ncb, device)
        counts = self._count_elements(h, rb, cb, BM, BN, device)
        in_range = _in_range_counts(rb, cb, BM, BN, self.L_q, self.L_k)
        return _classify(counts, in_range).view(self.num_heads, nrb, ncb)

    def allowed_elements(
        self, head: int | None = None, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The allowed ``(head, query, key)`` triples (``int64`` on ``device``, in block
        order; head 0 for a shared mask), of every head or of head ``head``. Built block
        by block like :meth:`to_graph`, but **not cached**: for callers that derive their
        own (cached) structure and should not keep an ``nnz``-sized graph alive as well."""
        device = _device(device)
        if head is not None:
            head = self._head_index(head)
        BM, BN = self._graph_block_size
        bmap = self._block_map3(BM, BN, device)
        if head is not None:
            bmap = bmap[head : head + 1]
        h, rb, cb = bmap.nonzero(as_tuple=True)
        if head is not None:
            h = torch.full_like(h, head)
        full = bmap[bmap != EMPTY] == FULL
        return block_edges(self, h, rb, cb, full, BM, BN, device)

    def _build_graph(self, head: int | None, device: torch.device) -> Graph:
        hh, qq, kk = self.allowed_elements(head, device)
        num_heads = 1 if head is not None or self.num_heads == 1 else self.num_heads
        if num_heads > 1:
            src, dst = hh * self.L_k + kk, hh * self.L_q + qq
        else:
            src, dst = kk, qq
        order = torch.argsort(dst * (num_heads * self.L_k) + src)
        edge_index = torch.stack([src[order], dst[order]])
        return Graph(edge_index, (num_heads * self.L_k, num_heads * self.L_q), validate=False)


def _block_indices(
    rb: Tensor, cb: Tensor, BM: int, BN: int, L_q: int, L_k: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Query / key indices ``[n, BM, 1]`` / ``[n, 1, BN]`` of blocks ``(rb, cb)``,
    clamped into range, and the in-range mask ``[n, BM, BN]``."""
    rb = rb.to(device=device, dtype=torch.int64)
    cb = cb.to(device=device, dtype=torch.int64)
    q = rb.view(-1, 1, 1) * BM + torch.arange(BM, device=device).view(1, -1, 1)
    k = cb.view(-1, 1, 1) * BN + torch.arange(BN, device=device).view(1, 1, -1)
    in_range = (q < L_q) & (k < L_k)
    return q.clamp(max=L_q - 1), k.clamp(max=L_k - 1), in_range


def _in_range_counts(rb: Tensor, cb: Tensor, BM: int, BN: int, L_q: int, L_k: int) -> Tensor:
    rows = torch.clamp(L_q - rb * BM, max=BM)
    cols = torch.clamp(L_k - cb * BN, max=BN)
    return rows * cols


def _all_blocks(H: int, nrb: int, ncb: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    idx = torch.arange(H * nrb * ncb, device=device)
    return idx // (nrb * ncb), (idx // ncb) % nrb, idx % ncb


def block_edges(
    mask: Mask,
    h: Tensor,
    rb: Tensor,
    cb: Tensor,
    full: Tensor,
    BM: int,
    BN: int,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(head, query, key)`` int64 index triples of the allowed elements of the
    non-empty blocks ``(h[i], rb[i], cb[i])`` (``full[i]``: every in-range element
    allowed; the others are partial), in block order, in chunks."""
    h = h.to(device=device, dtype=torch.int64)
    rb = rb.to(device=device, dtype=torch.int64)
    cb = cb.to(device=device, dtype=torch.int64)
    full = full.to(device)
    part = (~full).nonzero(as_tuple=True)[0]
    pid = torch.full((rb.numel(),), -1, dtype=torch.int64, device=device)
    patterns = torch.zeros((0, BM, BN), dtype=torch.bool, device=device)
    if part.numel():
        patterns, pid[part] = mask._patterns(h[part], rb[part], cb[part], BM, BN, device)
    outs: list[tuple[Tensor, Tensor, Tensor]] = []
    step = max(1, _CHUNK_ELEMENTS // (BM * BN))
    for s in range(0, rb.numel(), step):
        sl = slice(s, s + step)
        el = _block_indices(rb[sl], cb[sl], BM, BN, mask.L_q, mask.L_k, device)[2].clone()
        sel = (pid[sl] >= 0).nonzero(as_tuple=True)[0]
        if sel.numel():
            el[sel] = patterns[pid[sl][sel]]
        blk, i, j = el.nonzero(as_tuple=True)
        outs.append((h[sl][blk], rb[sl][blk] * BM + i, cb[sl][blk] * BN + j))
    if not outs:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, empty
    return tuple(torch.cat(parts) for parts in zip(*outs))  # type: ignore[return-value]


def _unique_rows(key: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(unique rows, inverse, first)``: ``key[first[u]] == unique[u]`` is the first
    row equal to ``unique[u]`` and ``key[i] == unique[inverse[i]]``."""
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    n = key.size(0)
    first = torch.full((uniq.size(0),), n, dtype=torch.int64, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=key.device), "amin")
    return uniq, inverse, first


def _edge_key(rb: Tensor, cb: Tensor, BM: int, BN: int, L_q: int, L_k: int) -> list[Tensor]:
    """In-range rows and columns of each block (what the ragged edge changes)."""
    return [torch.clamp(L_q - rb * BM, max=BM), torch.clamp(L_k - cb * BN, max=BN)]


# ----------------------------------------------------------------------------- atomic masks
class _Square(Mask):
    def __init__(self, L: int) -> None:
        L = _check_int(L, "L", 1)
        super().__init__(L, L)

    @property
    def L(self) -> int:
        return self.L_q

    def _bounds(self, BM: int, BN: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``a, b`` ``[nrb, 1]`` first / last in-range query; ``c, d`` ``[1, ncb]`` keys."""
        nrb, ncb = self.num_blocks(BM, BN)
        a, b = _block_bounds(self.L_q, BM, nrb, device)
        c, d = _block_bounds(self.L_k, BN, ncb, device)
        return a.view(-1, 1), b.view(-1, 1), c.view(1, -1), d.view(1, -1)

    def _params(self) -> str:
        return ""

    def __repr__(self) -> str:
        params = self._params()
        return f"{type(self).__name__}(L={self.L}{', ' + params if params else ''})"


class _ShiftInvariant(_Square):
    """A mask that depends on ``q - k`` only: a block's pattern is fixed by the offset
    ``rb*BM - cb*BN`` and by how much of it lies in range."""

    def _pattern_key(self, h, rb, cb, BM, BN):
        return torch.stack([rb * BM - cb * BN, *_edge_key(rb, cb, BM, BN, self.L_q, self.L_k)], 1)


class Causal(_ShiftInvariant):
    """``allowed(q, k) = k <= q`` (see :func:`causal`)."""

    def _allowed(self, q, k, h):
        return k <= q

    def _on_residues(self, d):  # k <= q  <=>  k // d <= q // d  when q = k (mod d)
        return Causal(-(-self.L // d))

    def _block_map(self, BM, BN, device):
        a, b, c, d = self._bounds(BM, BN, device)
        return _codes(empty=c > b, full=d <= a).unsqueeze(0)

    def _structure(self, BM, BN, device):
        return "full" if self.L == 1 else "causal"


class SlidingWindow(_ShiftInvariant):
    """``allowed(q, k) = |q - k| <= window`` (see :func:`sliding_window`)."""

    def __init__(self, L: int, window: int) -> None:
        super().__init__(L)
        self.window = _check_int(window, "window", 0)
        self._w = min(self.window, self.L)  # |q - k| < L: the same mask, in int64 range

    def _params(self):
        return f"window={self.window}"

    def _allowed(self, q, k, h):
        return (q - k).abs() <= self._w

    def _on_residues(self, d):  # |q - k| = d |q // d - k // d| when q = k (mod d)
        return SlidingWindow(-(-self.L // d), self._w // d)

    def _block_map(self, BM, BN, device):
        a, b, c, d = self._bounds(BM, BN, device)
        lo, hi = a - d, b - c  # q - k takes every integer value in [lo, hi] in the block
        w = self._w
        return _codes(empty=(lo > w) | (hi < -w), full=(lo >= -w) & (hi <= w)).unsqueeze(0)


class Dilated(_ShiftInvariant):
    """``allowed(q, k) = |q - k| <= window * dilation and (q - k) % dilation == 0``
    (see :func:`dilated`)."""

    def __init__(self, L: int, window: int, dilation: int) -> None:
        super().__init__(L)
        self.window = _check_int(window, "window", 0)
        self.dilation = _check_int(dilation, "dilation", 1)
        # the same mask in int64 range: |q - k| < L, so a span or a dilation >= L acts as L
        # (a dilation >= L leaves q - k = 0 its only multiple)
        self._span = min(self.window * self.dilation, self.L)
        self._s = min(self.dilation, self.L)

    def _params(self):
        return f"window={self.window}, dilation={self.dilation}"

    def _allowed(self, q, k, h):
        diff = q - k
        return (diff.abs() <= self._span) & (diff % self._s == 0)

    def _on_residues(self, d):  # q - k is a multiple of d, so of the dilation when it divides d
        if d % self._s:
            return None
        return SlidingWindow(-(-self.L // d), self._span // d)

    def _dilation_split(self):
        if self._s == 1:
            return None
        return self._s, self._on_residues(self._s)

    def _block_map(self, BM, BN, device):
        a, b, c, d = self._bounds(BM, BN, device)
        lo, hi = a - d, b - c  # every integer in [lo, hi] is some q - k of the block
        s, W = self._s, self._span
        lo_c, hi_c = lo.clamp(min=-W), hi.clamp(max=W)
        first_multiple = -_floor_div(-lo_c, s) * s  # smallest multiple of s >= lo_c
        empty = (lo_c > hi_c) | (first_multiple > hi_c)
        inside = (lo >= -W) & (hi <= W)
        if s == 1:
            full = inside
        else:  # only a single difference (a 1 x 1 in-range block) can be all multiples of s
            full = inside & (lo == hi) & (lo % s == 0)
        return _codes(empty=empty, full=full).unsqueeze(0)


class GlobalTokens(_Square):
    """``allowed(q, k) = q < num_global or k < num_global`` (see :func:`global_tokens`)."""

    def __init__(self, L: int, num_global: int) -> None:
        super().__init__(L)
        self.num_global = _check_int(num_global, "num_global", 0)
        self._g = min(self.num_global, self.L)  # the same mask, in int64 range

    def _params(self):
        return f"num_global={self.num_global}"

    def _allowed(self, q, k, h):
        g = self._g
        return (q < g) | (k < g)

    def _pattern_key(self, h, rb, cb, BM, BN):
        g = self._g
        rows = torch.clamp(g - rb * BM, min=0, max=BM)  # global rows of the block
        cols = torch.clamp(g - cb * BN, min=0, max=BN)
        return torch.stack([rows, cols, *_edge_key(rb, cb, BM, BN, self.L_q, self.L_k)], 1)

    def _block_map(self, BM, BN, device):
        a, b, c, d = self._bounds(BM, BN, device)
        g = self._g
        return _codes(empty=(a >= g) & (c >= g), full=(b < g) | (d < g)).unsqueeze(0)


class RandomBlocks(_Square):
    """``allowed(q, k) = R[q // block, k // block]`` for a seeded random boolean table
    ``R`` (see :func:`random_blocks`)."""

    def __init__(self, L: int, block: int, density: float, seed: int) -> None:
        super().__init__(L)
        self.block = _check_int(block, "block", 1)
        self._b = min(self.block, self.L)  # one cell of R either way: the same mask, in int64 range
        if isinstance(density, bool) or not isinstance(density, Real):
            raise TypeError(f"density must be a float in [0, 1], got {type(density).__name__}")
        density = float(density)
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"density must lie in [0, 1], got {density}")
        self.density = density
        self.seed = _check_int(seed, "seed", 0)
        if self.seed >= 2**64:
            raise ValueError(f"seed must be < 2**64 (a torch.Generator seed), got {self.seed}")
        nb = math.ceil(L / self.block)
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        table = torch.rand((nb, nb), generator=gen, dtype=torch.float64) < density
        self._table = _DeviceBuffer(table)
        # 2-D prefix sums S[i, j] = R[:i, :j].sum() for analytic block maps
        prefix = torch.zeros((nb + 1, nb + 1), dtype=torch.int64)
        prefix[1:, 1:] = table.long().cumsum(0).cumsum(1)
        self._prefix = _DeviceBuffer(prefix)

    @property
    def table(self) -> Tensor:
        """The ``[ceil(L / block)] * 2`` boolean table ``R`` (on the CPU; a copy)."""
        return self._table.cpu.clone()

    def _params(self):
        return f"block={self.block}, density={self.density}, seed={self.seed}"

    def _allowed(self, q, k, h):
        table = self._table.on(q.device)
        return table[_floor_div(q, self._b), _floor_div(k, self._b)]

    def _pattern_key(self, h, rb, cb, BM, BN):
        # A block's pattern is fixed by where it starts inside a cell of R, its
        # in-range size and the cells of R it covers.
        g = self._b
        nr, nc = (BM + g - 1) // g + 1, (BN + g - 1) // g + 1  # most cells a block covers
        if nr * nc > 256:  # tiny random blocks: patterns are essentially unique anyway
            return None
        rows_in, cols_in = _edge_key(rb, cb, BM, BN, self.L_q, self.L_k)
        off_r, off_c = (rb * BM) % g, (cb * BN) % g
        table = self._table.on(rb.device)
        n_cells = table.size(0)
        cr = (rb * BM // g).view(-1, 1) + torch.arange(nr, device=rb.device).view(1, -1)
        cc = (cb * BN // g).view(-1, 1) + torch.arange(nc, device=rb.device).view(1, -1)
        # cell t is covered iff t * g < offset + in-range size
        cover_r = torch.arange(nr, device=rb.device).view(1, -1) * g < (off_r + rows_in).view(-1, 1)
        cover_c = torch.arange(nc, device=rb.device).view(1, -1) * g < (off_c + cols_in).view(-1, 1)
        bits = table[cr.clamp(max=n_cells - 1).unsqueeze(2), cc.clamp(max=n_cells - 1).unsqueeze(1)]
        bits = bits & cover_r.unsqueeze(2) & cover_c.unsqueeze(1)
        return torch.cat([torch.stack([off_r, off_c, rows_in, cols_in], 1), bits.flatten(1).long()], 1)

    def _block_map(self, BM, BN, device):
        a, b, c, d = self._bounds(BM, BN, device)
        g = self._b
        r0, r1, c0, c1 = a // g, b // g, c // g, d // g  # covered cells of R (inclusive)
        S = self._prefix.on(device)
        count = S[r1 + 1, c1 + 1] - S[r0, c1 + 1] - S[r1 + 1, c0] + S[r0, c0]
        cells = (r1 - r0 + 1) * (c1 - c0 + 1)
        return _codes(empty=count == 0, full=count == cells).unsqueeze(0)


# ----------------------------------------------------------------------------- element masks
class DenseMask(Mask):
    """``allowed(q, k) = M[q, k]`` (``M[h, q, k]`` per head) for a stored boolean matrix
    (see :func:`from_dense`)."""

    def __init__(self, matrix: Tensor) -> None:
        if not isinstance(matrix, Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(matrix).__name__}")
        if matrix.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got dtype {matrix.dtype}")
        if matrix.dim() not in (2, 3):
            raise ValueError(f"mask must have shape [L_q, L_k] or [H, L_q, L_k], got {tuple(matrix.shape)}")
        m3 = matrix.detach().to("cpu", copy=True)
        if m3.dim() == 2:
            m3 = m3.unsqueeze(0)
        super().__init__(m3.size(1), m3.size(2), m3.size(0))
        self._matrix = _DeviceBuffer(m3.contiguous())

    def _allowed(self, q, k, h):
        m = self._matrix.on(q.device)
        return m[0][q, k] if h is None else m[h, q, k]

    def _block_map(self, BM, BN, device):
        nrb, ncb = self.num_blocks(BM, BN)
        m = self._matrix.on(device)
        padded = torch.zeros((self.num_heads, nrb * BM, ncb * BN), dtype=torch.int32, device=device)
        padded[:, : self.L_q, : self.L_k] = m
        counts = padded.view(self.num_heads, nrb, BM, ncb, BN).sum(dim=(2, 4))
        rb = torch.arange(nrb, device=device).view(-1, 1)
        cb = torch.arange(ncb, device=device).view(1, -1)
        return _classify(counts, _in_range_counts(rb, cb, BM, BN, self.L_q, self.L_k))


class GraphMask(Mask):
    """``allowed(q, k)`` iff the graph has an edge ``k -> q`` (see :func:`from_graph`)."""

    def __init__(self, src: Tensor, dst: Tensor, L_q: int, L_k: int) -> None:
        super().__init__(L_q, L_k)
        keys = torch.unique(dst.detach().to("cpu", torch.int64) * L_k + src.detach().to("cpu", torch.int64))
        self._keys = _DeviceBuffer(keys)  # sorted, unique q * L_k + k

    @property
    def num_allowed(self) -> int:
        """Number of distinct allowed ``(q, k)`` pairs."""
        return self._keys.cpu.numel()

    def _allowed(self, q, k, h):
        keys = self._keys.on(q.device)
        key = q.long() * self.L_k + k.long()
        if keys.numel() == 0:
            return torch.zeros_like(key, dtype=torch.bool)
        pos = torch.searchsorted(keys, key.reshape(-1)).clamp(max=keys.numel() - 1)
        return (keys[pos] == key.reshape(-1)).view(key.shape)

    def _elements(self, h, rb, cb, BM, BN, device):
        # scatter the edges that fall into the requested blocks (no per-element search)
        nrb, ncb = self.num_blocks(BM, BN)
        rb, cb = rb.to(device=device, dtype=torch.int64), cb.to(device=device, dtype=torch.int64)
        slot = torch.full((nrb * ncb,), -1, dtype=torch.int64, device=device)
        slot[rb * ncb + cb] = torch.arange(rb.numel(), device=device)
        keys = self._keys.on(device)
        q, k = keys // self.L_k, keys % self.L_k
        pos = slot[(q // BM) * ncb + k // BN]
        hit = pos >= 0
        out = torch.zeros((rb.numel(), BM, BN), dtype=torch.bool, device=device)
        out[pos[hit], q[hit] % BM, k[hit] % BN] = True
        return out

    def _elements_chunked(self, h, rb, cb, BM, BN, device):
        return self._elements(h, rb, cb, BM, BN, device)

    def _block_map(self, BM, BN, device):
        nrb, ncb = self.num_blocks(BM, BN)
        keys = self._keys.on(device)
        q, k = keys // self.L_k, keys % self.L_k
        counts = torch.bincount((q // BM) * ncb + k // BN, minlength=nrb * ncb).view(nrb, ncb)
        rb = torch.arange(nrb, device=device).view(-1, 1)
        cb = torch.arange(ncb, device=device).view(1, -1)
        return _classify(counts, _in_range_counts(rb, cb, BM, BN, self.L_q, self.L_k)).unsqueeze(0)


class HeadStack(Mask):
    """One shared mask per head: ``allowed(q, k, h) = masks[h].allowed(q, k)``
    (see :func:`stack_heads`)."""

    def __init__(self, masks: Sequence[Mask]) -> None:
        masks = list(masks)
        if not masks:
            raise ValueError("masks must hold at least one mask")
        for i, m in enumerate(masks):
            if not isinstance(m, Mask):
                raise TypeError(f"masks[{i}] must be a Mask, got {type(m).__name__}")
            if m.num_heads != 1:
                raise ValueError(f"masks[{i}] is itself per-head ({m.num_heads} heads); stack shared masks")
            if m.shape != masks[0].shape:
                raise ValueError(f"masks[{i}] is {m.shape[0]} x {m.shape[1]}, masks[0] is {masks[0].shape[0]} x {masks[0].shape[1]}")
        super().__init__(masks[0].L_q, masks[0].L_k, len(masks))
        self.masks = tuple(masks)

    def __repr__(self) -> str:
        return f"HeadStack({list(self.masks)!r})"

    def _allowed(self, q, k, h):
        if h is None:
            if self.num_heads == 1:  # a stack of one mask is that mask, shared (read without a head)
                return self.masks[0]._allowed(q, k, None)
            raise ValueError("a per-head mask needs a head index")
        out = None
        for i, m in enumerate(self.masks):
            term = (h == i) & m._allowed(q, k, None)
            out = term if out is None else out | term
        return out

    def _block_map(self, BM, BN, device):
        return torch.cat([m._block_map3(BM, BN, device) for m in self.masks])

    def _elements(self, h, rb, cb, BM, BN, device):
        h = h.to(device)
        out = torch.zeros((rb.numel(), BM, BN), dtype=torch.bool, device=device)
        for i, m in enumerate(self.masks):
            sel = (h == i).nonzero(as_tuple=True)[0]
            if sel.numel():
                out[sel] = m._elements(h[sel], rb.to(device)[sel], cb.to(device)[sel], BM, BN, device)
        return out

    def _patterns(self, h, rb, cb, BM, BN, device):
        h, rb, cb = (t.to(device=device, dtype=torch.int64) for t in (h, rb, cb))
        pid = torch.empty(rb.numel(), dtype=torch.int64, device=device)
        tables, offset = [], 0
        for i, m in enumerate(self.masks):
            sel = (h == i).nonzero(as_tuple=True)[0]
            if sel.numel():
                pats, sub = m._patterns(h[sel], rb[sel], cb[sel], BM, BN, device)
                pid[sel] = sub + offset
                tables.append(pats)
                offset += pats.size(0)
        if not tables:
            return torch.zeros((0, BM, BN), dtype=torch.bool, device=device), pid
        return torch.cat(tables), pid


class CombinedMask(Mask):
    """Union (``|``) or intersection (``&``) of masks."""

    def __init__(self, op: str, parts: Sequence[Mask], name: str | None = None) -> None:
        parts = list(parts)
        heads = {m.num_heads for m in parts} - {1}
        if len(heads) > 1:
            raise ValueError(f"cannot combine masks with {sorted(heads)} heads (need equal heads, or shared masks)")
        for m in parts[1:]:
            if m.shape != parts[0].shape:
                raise ValueError(
                    f"cannot combine a {parts[0].L_q} x {parts[0].L_k} mask with a {m.L_q} x {m.L_k} mask"
                )
        super().__init__(parts[0].L_q, parts[0].L_k, heads.pop() if heads else 1)
        self.op = op
        self.parts = tuple(parts)
        self.name = name

    @classmethod
    def make(cls, op: str, a: Mask, b: Mask, name: str | None = None) -> "CombinedMask":
        for side in (a, b):
            if not isinstance(side, Mask):
                raise TypeError(f"can only combine a Mask with a Mask, got {type(side).__name__}")
        parts: list[Mask] = []
        for side in (a, b):  # flatten nested unions / intersections (unnamed ones)
            if isinstance(side, CombinedMask) and side.op == op and side.name is None:
                parts.extend(side.parts)
            else:
                parts.append(side)
        return cls(op, parts, name)

    def __repr__(self) -> str:
        joiner = " | " if self.op == "union" else " & "
        inner = joiner.join(repr(p) for p in self.parts)
        return f"{self.name}({inner})" if self.name else f"({inner})"

    def _allowed(self, q, k, h):
        results = [p._allowed(q, k, h if p.num_heads > 1 else None) for p in self.parts]
        out = results[0]
        for r in results[1:]:
            out = (out | r) if self.op == "union" else (out & r)
        return out

    def _on_residues(self, d):
        parts = [p._on_residues(d) for p in self.parts]
        if any(p is None for p in parts):
            return None
        return CombinedMask(self.op, parts)

    def _dilation_split(self):
        # an intersection with a part that splits by d splits when every other part is
        # the same on each residue of d (a dilated window & causal: causal on each)
        if self.op != "intersection":
            return None
        for part in self.parts:
            split = part.dilation_split()
            if split is not None:
                base = self._on_residues(split[0])
                return None if base is None else (split[0], base)
        return None

    def _elements(self, h, rb, cb, BM, BN, device):
        out = None
        for p in self.parts:
            el = p._elements(h if p.num_heads > 1 else torch.zeros_like(h), rb, cb, BM, BN, device)
            out = el if out is None else ((out | el) if self.op == "union" else (out & el))
        return out

    def _patterns(self, h, rb, cb, BM, BN, device):
        # Describe each block by (in-range size, per part: -2 empty / -1 full / pattern
        # id), combine the parts' patterns once per distinct description.
        h, rb, cb = (t.to(device=device, dtype=torch.int64) for t in (h, rb, cb))
        columns = _edge_key(rb, cb, BM, BN, self.L_q, self.L_k)
        tables = []
        for p in self.parts:
            hp = h if p.num_heads > 1 else torch.zeros_like(h)
            code = p._block_map3(BM, BN, device)[hp, rb, cb]
            col = torch.where(code == FULL, -1, -2).to(torch.int64)
            sel = (code == PARTIAL).nonzero(as_tuple=True)[0]
            pats = torch.zeros((0, BM, BN), dtype=torch.bool, device=device)
            if sel.numel():
                pats, col[sel] = p._patterns(hp[sel], rb[sel], cb[sel], BM, BN, device)
            columns.append(col)
            tables.append(pats)
        key = torch.stack(columns, 1)
        uniq, pid, first = _unique_rows(key)
        in_range = _block_indices(rb[first], cb[first], BM, BN, self.L_q, self.L_k, device)[2]
        out = None
        for j, pats in enumerate(tables):
            c = uniq[:, 2 + j].view(-1, 1, 1)
            el = in_range & (c == -1)
            if pats.size(0):
                el = el | ((c >= 0) & pats[c.view(-1).clamp(min=0)])
            out = el if out is None else ((out | el) if self.op == "union" else (out & el))
        return out, pid

    def _block_map(self, BM, BN, device):
        maps = [p._block_map3(BM, BN, device) for p in self.parts]
        shape = (self.num_heads,) + maps[0].shape[1:]
        maps = [m.expand(shape) for m in maps]
        n_partial = sum((m == PARTIAL).to(torch.int32) for m in maps)
        any_full = torch.stack([m == FULL for m in maps]).any(0)
        all_full = torch.stack([m == FULL for m in maps]).all(0)
        any_empty = torch.stack([m == EMPTY for m in maps]).any(0)
        all_empty = torch.stack([m == EMPTY for m in maps]).all(0)
        if self.op == "union":
            code = _codes(empty=all_empty, full=any_full)
            # no full part, >= 2 partial parts: their union may cover the block
            ambiguous = ~any_full & (n_partial >= 2)
        else:
            code = _codes(empty=any_empty, full=all_full)
            # no empty part, >= 2 partial parts: their intersection may be empty
            ambiguous = ~any_empty & (n_partial >= 2)
        h, rb, cb = ambiguous.nonzero(as_tuple=True)
        if h.numel():
            counts = self._count_elements(h, rb, cb, BM, BN, device)
            in_range = _in_range_counts(rb, cb, BM, BN, self.L_q, self.L_k)
            code[h, rb, cb] = _classify(counts, in_range)
        return code


# ----------------------------------------------------------------------------- constructors
def causal(L: int) -> Mask:
    r"""Causal mask of length ``L``: query ``q`` attends to keys ``k <= q``.

    .. math:: \mathrm{allowed}(q, k) = [k \le q], \qquad 0 \le q, k < L
    """
    return Causal(L)


def sliding_window(L: int, window: int) -> Mask:
    r"""Symmetric sliding window: query ``q`` attends to the ``2 * window + 1`` keys
    around it (fewer at the ends).

    .. math:: \mathrm{allowed}(q, k) = [\,|q - k| \le \mathrm{window}\,]
    """
    return SlidingWindow(L, window)


def dilated(L: int, window: int, dilation: int) -> Mask:
    r"""Dilated sliding window: every ``dilation``-th key within ``window`` dilated steps.

    .. math:: \mathrm{allowed}(q, k) = [\,|q - k| \le \mathrm{window}\cdot\mathrm{dilation}
        \ \wedge\ (q - k) \bmod \mathrm{dilation} = 0\,]

    ``dilated(L, w, 1)`` equals ``sliding_window(L, w)``.
    """
    return Dilated(L, window, dilation)


def global_tokens(L: int, num_global: int) -> Mask:
    r"""Global tokens: the first ``num_global`` positions attend to everything and are
    attended to by everything.

    .. math:: \mathrm{allowed}(q, k) = [\,q < g \ \vee\ k < g\,], \qquad g = \mathrm{num\_global}
    """
    return GlobalTokens(L, num_global)


def random_blocks(L: int, block: int, density: float, seed: int) -> Mask:
    r"""Random blocks of ``block x block`` elements, each allowed with probability
    ``density``, reproducibly from ``seed``.

    .. math:: \mathrm{allowed}(q, k) = R[\lfloor q / \mathrm{block} \rfloor,
        \lfloor k / \mathrm{block} \rfloor]

    with ``R = torch.rand((n, n), generator=torch.Generator("cpu").manual_seed(seed),
    dtype=torch.float64) < density`` and ``n = ceil(L / block)`` (the last random block
    row / column is cut at ``L``). ``R`` is drawn on the CPU, so the mask is the same on
    every device and run.
    """
    return RandomBlocks(L, block, density, seed)


def longformer(L: int, window: int, num_global: int) -> Mask:
    r"""Longformer: sliding window plus global tokens.

    .. math:: \mathrm{allowed}(q, k) = [\,|q - k| \le \mathrm{window}\,] \ \vee\
        [\,q < g \ \vee\ k < g\,]
    """
    return CombinedMask("union", [SlidingWindow(L, window), GlobalTokens(L, num_global)], "Longformer")


def bigbird(
    L: int,
    window: int,
    num_global: int,
    random_block: int,
    random_density: float,
    seed: int,
) -> Mask:
    r"""BigBird: sliding window, global tokens and random blocks.

    .. math:: \mathrm{allowed}(q, k) = [\,|q - k| \le \mathrm{window}\,] \ \vee\
        [\,q < g \ \vee\ k < g\,] \ \vee\ R[\lfloor q / b \rfloor, \lfloor k / b \rfloor]

    with ``g = num_global``, ``b = random_block`` and ``R`` the table of
    :func:`random_blocks` ``(L, random_block, random_density, seed)``.
    """
    parts = [
        SlidingWindow(L, window),
        GlobalTokens(L, num_global),
        RandomBlocks(L, random_block, random_density, seed),
    ]
    return CombinedMask("union", parts, "BigBird")


def from_dense(mask: Tensor) -> Mask:
    r"""A mask from a boolean matrix: ``allowed(q, k) = mask[q, k]``.

    ``mask`` is ``[L_q, L_k]`` (shared by all heads) or ``[H, L_q, L_k]`` (per head,
    ``allowed(q, k, h) = mask[h, q, k]``). It is copied (to the CPU); later changes to
    ``mask`` do not affect the result.
    """
    return DenseMask(mask)


def from_graph(
    graph: Graph | Tensor,
    L_q: int | None = None,
    L_k: int | None = None,
) -> Mask:
    r"""A mask from a graph: query ``q`` attends to key ``k`` iff there is an edge
    ``k -> q`` (source = key, target = query, the direction of :meth:`Mask.to_graph`).

    .. math:: \mathrm{allowed}(q, k) = [\,(k \to q) \in E\,]

    Args:
        graph: a :class:`~fusegnn.sparse.Graph` (``num_nodes=(L_k, L_q)``), an
            ``edge_index`` ``[2, E]`` (row 0 keys, row 1 queries), or a ``torch.sparse``
            COO / CSR matrix ``[L_q, L_k]`` whose stored entries ``(q, k)`` are allowed
            (rows are queries, as in ``Graph.from_sparse``).
        L_q, L_k: numbers of queries and keys; required for an ``edge_index``
            (``L_k`` defaults to ``L_q``), taken from the graph or matrix otherwise (and
            checked against it when given).

    Duplicate edges count once.
    """
    if isinstance(graph, Tensor) and graph.layout not in (torch.strided, torch.sparse_coo, torch.sparse_csr):
        raise TypeError(f"graph: a torch.sparse matrix must be COO or CSR, got {graph.layout}; convert it with .to_sparse_coo()")
    if isinstance(graph, Tensor) and graph.layout in (torch.sparse_coo, torch.sparse_csr):
        if graph.dim() != 2:
            raise ValueError(f"graph must be a 2-D sparse matrix [L_q, L_k], got shape {tuple(graph.shape)}")
        sizes = (graph.size(0), graph.size(1))
        graph = Graph.from_sparse(graph)
        graph = Graph(graph.edge_index, (sizes[1], sizes[0]), validate=False)
    if isinstance(graph, Graph):
        gq, gk = graph.num_dst_nodes, graph.num_src_nodes
        for name, given, have in (("L_q", L_q, gq), ("L_k", L_k, gk)):
            if given is not None and _check_int(given, name, 1) != have:
                raise ValueError(f"{name}={given} but the graph has {have} ({'targets' if name == 'L_q' else 'sources'})")
        return GraphMask(graph.src, graph.dst, gq, gk)
    if isinstance(graph, Tensor):
        if L_q is None:
            raise ValueError("L_q is required when graph is an edge_index tensor")
        L_q = _check_int(L_q, "L_q", 1)
        L_k = L_q if L_k is None else _check_int(L_k, "L_k", 1)
        g = Graph(graph, (L_k, L_q))  # validates shape, dtype and ids
        return GraphMask(g.src, g.dst, L_q, L_k)
    raise TypeError(
        f"graph must be a fusegnn.sparse.Graph, an edge_index tensor or a torch.sparse matrix, got {type(graph).__name__}"
    )


def stack_heads(masks: Sequence[Mask]) -> Mask:
    r"""A per-head mask from one shared mask per head:
    ``allowed(q, k, h) = masks[h].allowed(q, k)``, ``num_heads = len(masks)``.

    All masks must have the same ``L_q x L_k`` and be shared (single-head) masks.
    """
    if isinstance(masks, Mask):
        raise TypeError("stack_heads takes a sequence of masks, one per head")
    return HeadStack(masks)
