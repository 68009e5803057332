r"""Block-sparse layout of an attention mask: STOF's full/part block format, extended
with the transposed index the backward pass needs.

The ``L_q x L_k`` mask is cut into ``BM x BN`` blocks (powers of two >= 16), giving a
grid of ``nrb = ceil(L_q / BM)`` block rows and ``ncb = ceil(L_k / BN)`` block columns.
Only non-empty blocks are stored. As in STOF (Sec. 4.2), a non-empty block is either

* **full** -- every in-range element is allowed: the kernel computes it densely, with no
  element mask (it still masks rows ``>= L_q`` and keys ``>= L_k`` of the ragged last
  block row / column, which do not count when classifying a block);
* **partial** -- its ``BM x BN`` element pattern is stored **once per distinct pattern**
  (a sliding window has a handful of distinct diagonal patterns however long ``L`` is)
  and the block points to it.

Full and partial blocks share one block-CSR index (STOF's ``load_row_ptr`` /
``load_col_idx``) with a per-block ``pattern_id`` (``-1`` = full) instead of STOF's two
separate full / part index pairs, so a kernel walks one list per block row.

Fields of :class:`BlockLayout` (all index tensors ``int32``, on the layout's device):

* ``L_q, L_k, BM, BN, num_heads`` (1 = one layout shared by all heads), ``nrb``, ``ncb``;
* forward index, by query block row, heads one after the other:
  ``row_ptr [num_heads, nrb + 1]`` holds **global** offsets into the flat arrays
  (``row_ptr[h, 0]`` is where head ``h`` starts, ``row_ptr[h, nrb] == row_ptr[h + 1, 0]``);
  the blocks of row ``r`` of head ``h`` are positions ``row_ptr[h, r] : row_ptr[h, r + 1]``
  of ``col_idx [nnzb]`` (key block column, increasing within a row) and
  ``pattern_id [nnzb]`` (``-1`` for a full block, else an index into ``patterns``);
* ``patterns: bool [P, BM, BN]`` -- the distinct partial-block patterns;
  ``patterns[p, i, j]`` says whether row ``rb*BM + i`` may attend to key ``cb*BN + j``
  in a block pointing to ``p``; ``False`` at rows / columns beyond ``L_q`` / ``L_k``.
  Patterns are sorted by their packed bits (deterministic), each stored once;
* transposed index, by key block column (for dK / dV): ``col_ptr [num_heads, ncb + 1]``
  (global offsets, as ``row_ptr``), ``row_idx [nnzb]`` (query block row, increasing
  within a column), ``t_block [nnzb]`` -- the forward position of each transposed entry,
  so its pattern is ``pattern_id[t_block]`` and its column ``col_idx[t_block]``;
* ``density`` (fraction of allowed ``(q, k)`` elements, over all heads),
  ``block_density`` (fraction of non-empty blocks), ``num_full``, ``num_partial``,
  ``max_row_blocks`` / ``max_col_blocks`` (most non-empty blocks in one block row /
  column, for kernel grids).

Contract additions over the lead's contract (additive only): ``max_row_blocks``,
``max_col_blocks``, ``nnzb``, ``device``, :meth:`BlockLayout.block_map`,
:meth:`BlockLayout.dense` and :meth:`BlockLayout.to_mask` (the layout as a
:class:`~fusegnn.attention.masks.Mask`, for the reference and element paths). ``patterns``
is ``torch.bool``.

:meth:`BlockLayout.from_mask` builds everything with tensor ops on the target device
(no Python loop over blocks): the mask's block map (analytic for structured masks),
element patterns of partial blocks only, dedupe by ``torch.unique`` over the packed
pattern bits, and a stable sort for the transposed index.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fusegnn.attention import handles
from fusegnn.attention.masks import EMPTY, FULL, PARTIAL, Mask, _check_int, _DeviceBuffer, _device

if TYPE_CHECKING:
    from fusegnn.kernels.block_attention import PreparedLayout

__all__ = ["BlockLayout", "check_block_size"]


def check_block_size(BM: object, BN: object) -> tuple[int, int]:
    """``(BM, BN)`` as ints; each must be a power of two >= 16 (ValueError otherwise)."""
    out = []
    for name, value in (("BM", BM), ("BN", BN)):
        value = _check_int(value, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        out.append(value)
    return out[0], out[1]


def _dedupe_patterns(patterns: Tensor) -> tuple[Tensor, Tensor]:
    """``(unique patterns, remap)`` with ``patterns[i] == unique[remap[i]]``, unique
    patterns sorted by their bytes read as int64 words (deterministic)."""
    P = patterns.size(0)
    # the 0/1 bytes of a bool tensor, 8 at a time, read as one int64: lossless and free
    words = patterns.contiguous().view(torch.uint8).reshape(P, -1).view(torch.int64)
    uniq, remap = torch.unique(words, dim=0, return_inverse=True)
    first = torch.full((uniq.size(0),), P, dtype=torch.int64, device=patterns.device)
    first.scatter_reduce_(0, remap, torch.arange(P, device=patterns.device), "amin")
    return patterns[first], remap


@dataclass(eq=False)
class BlockLayout(handles.Handled):
    """Block-sparse (BCSR) layout of an attention mask; see the module docstring. A copy
    has a handle of its own and prepares its kernel data again on use."""

    _DERIVED = {"_prepared": lambda: None}

    L_q: int
    L_k: int
    BM: int
    BN: int
    num_heads: int
    nrb: int
    ncb: int
    row_ptr: Tensor
    col_idx: Tensor
    pattern_id: Tensor
    patterns: Tensor
    col_ptr: Tensor
    row_idx: Tensor
    t_block: Tensor
    density: float
    block_density: float
    num_full: int
    num_partial: int
    max_row_blocks: int
    max_col_blocks: int
    _mask: Mask | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.handle = handles.register(self)  # what compiled code passes to the custom ops
        self._prepared: PreparedLayout | None = None  # see prepared()
        self.BM, self.BN = check_block_size(self.BM, self.BN)
        H, nnzb = self.num_heads, self.col_idx.numel()
        expected = {
            "row_ptr": (H, self.nrb + 1),
            "col_idx": (nnzb,),
            "pattern_id": (nnzb,),
            "col_ptr": (H, self.ncb + 1),
            "row_idx": (nnzb,),
            "t_block": (nnzb,),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32 of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if self.patterns.dim() != 3 or self.patterns.shape[1:] != (self.BM, self.BN):
            raise ValueError(f"patterns must be [P, {self.BM}, {self.BN}], got {tuple(self.patterns.shape)}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mask(
        cls,
        mask: Mask,
        BM: int,
        BN: int,
        device: torch.device | str | None = None,
    ) -> "BlockLayout":
        """Build the layout of ``mask`` at ``BM x BN`` blocks (powers of two >= 16) on
        ``device`` (default CPU)."""
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a fusegnn.attention.masks.Mask, got {type(mask).__name__}")
        BM, BN = check_block_size(BM, BN)
        device = _device(device)
        H = mask.num_heads
        nrb, ncb = mask.num_blocks(BM, BN)
        bmap = mask._block_map3(BM, BN, device)  # int8 [H, nrb, ncb]
        nonempty = bmap != EMPTY
        h, rb, cb = nonempty.nonzero(as_tuple=True)  # row-major: (head, block row, block col)
        codes = bmap[nonempty]
        nnzb = rb.numel()

        # forward index
        row_counts = nonempty.sum(dim=2, dtype=torch.int64).reshape(-1)  # [H * nrb]
        flat_ptr = torch.zeros(H * nrb + 1, dtype=torch.int64, device=device)
        torch.cumsum(row_counts, 0, out=flat_ptr[1:])
        row_ptr = torch.stack([flat_ptr[i * nrb : i * nrb + nrb + 1] for i in range(H)])

        # partial patterns, deduplicated by content
        partial = (codes == PARTIAL).nonzero(as_tuple=True)[0]
        pattern_id = torch.full((nnzb,), -1, dtype=torch.int64, device=device)
        if partial.numel():
            patterns, pid = mask._patterns(h[partial], rb[partial], cb[partial], BM, BN, device)
            patterns, remap = _dedupe_patterns(patterns)
            pattern_id[partial] = remap[pid]
        else:
            patterns = torch.zeros((0, BM, BN), dtype=torch.bool, device=device)

        # transposed index: stable sort of the blocks by (head, block col); rows stay sorted
        t_block = torch.argsort(h * ncb + cb, stable=True)
        col_counts = nonempty.sum(dim=1, dtype=torch.int64).reshape(-1)  # [H * ncb]
        flat_cptr = torch.zeros(H * ncb + 1, dtype=torch.int64, device=device)
        torch.cumsum(col_counts, 0, out=flat_cptr[1:])
        col_ptr = torch.stack([flat_cptr[i * ncb : i * ncb + ncb + 1] for i in range(H)])

        # statistics
        rows_in = torch.clamp(mask.L_q - rb * BM, max=BM)
        cols_in = torch.clamp(mask.L_k - cb * BN, max=BN)
        full = codes == FULL
        allowed = int((rows_in * cols_in)[full].sum())
        if partial.numel():
            allowed += int(patterns.sum(dim=(1, 2))[pattern_id[partial]].sum())
        num_full = int(full.sum())
        i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
        layout = cls(
            L_q=mask.L_q,
            L_k=mask.L_k,
            BM=BM,
            BN=BN,
            num_heads=H,
            nrb=nrb,
            ncb=ncb,
            row_ptr=i32(row_ptr),
            col_idx=i32(cb),
            pattern_id=i32(pattern_id),
            patterns=patterns.contiguous(),
            col_ptr=i32(col_ptr),
            row_idx=i32(rb[t_block]),
            t_block=i32(t_block),
            density=allowed / (H * mask.L_q * mask.L_k),
            block_density=nnzb / (H * nrb * ncb),
            num_full=num_full,
            num_partial=nnzb - num_full,
            max_row_blocks=int(row_counts.max()) if row_counts.numel() else 0,
            max_col_blocks=int(col_counts.max()) if col_counts.numel() else 0,
        )
        return layout

    # ------------------------------------------------------------------ facts
    @property
    def nnzb(self) -> int:
        """Number of non-empty blocks (over all heads)."""
        return self.col_idx.numel()

    @property
    def num_patterns(self) -> int:
        return self.patterns.size(0)

    @property
    def device(self) -> torch.device:
        return self.col_idx.device

    def __repr__(self) -> str:
        heads = f", num_heads={self.num_heads}" if self.num_heads > 1 else ""
        return (
            f"BlockLayout(L_q={self.L_q}, L_k={self.L_k}, BM={self.BM}, BN={self.BN}{heads}, "
            f"blocks={self.nnzb}/{self.num_heads * self.nrb * self.ncb} (full {self.num_full}, "
            f"partial {self.num_partial}, patterns {self.num_patterns}), density={self.density:.4f}, "
            f"device={self.device})"
        )

    def prepared(self, device: torch.device | str) -> "PreparedLayout":
        """The block kernels' view of this layout on ``device``
        (:func:`fusegnn.kernels.block_attention.prepare_layout`: each block row and column
        with its partial blocks first, the heavy-first schedules, the diagonal bands) with
        the launch plans of the calls seen so far; built on first use and kept here, so
        that a repeated call does no layout work."""
        prepared = self._prepared
        if prepared is not None and prepared.device == device:  # the kernels' per-call path
            return prepared
        device = torch.device(device)
        if prepared is not None and prepared.device == device:
            return prepared
        from fusegnn.kernels.block_attention import prepare_layout

        prepared = self._prepared = prepare_layout(self, device)
        return prepared

    def to(self, device: torch.device | str) -> "BlockLayout":
        """The same layout with its tensors on ``device``."""
        device = torch.device(device)
        if device == self.device:
            return self
        values = {}
        for f in fields(self):
            if f.name == "_mask":
                continue
            v = getattr(self, f.name)
            values[f.name] = v.to(device) if isinstance(v, Tensor) else v
        return BlockLayout(**values, _mask=self._mask)

    # ------------------------------------------------------------------ views
    def _block_coords(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(head, block row, block col)`` int64 of each forward block."""
        device = self.device
        counts = (self.row_ptr[:, 1:] - self.row_ptr[:, :-1]).reshape(-1).long()
        hr = torch.repeat_interleave(torch.arange(self.num_heads * self.nrb, device=device), counts)
        return hr // self.nrb, hr % self.nrb, self.col_idx.long()

    def block_table(self) -> Tensor:
        """``int32 [num_heads, nrb, ncb]``: ``-2`` empty, ``-1`` full, ``p >= 0`` a
        partial block with pattern ``p``."""
        h, rb, cb = self._block_coords()
        table = torch.full((self.num_heads, self.nrb, self.ncb), -2, dtype=torch.int32, device=self.device)
        table[h, rb, cb] = self.pattern_id
        return table

    def block_map(self) -> Tensor:
        """``int8`` block codes (0 empty, 1 partial, 2 full) like
        :meth:`Mask.block_map`: ``[nrb, ncb]``, or ``[H, nrb, ncb]`` per head."""
        table = self.block_table()
        code = torch.full(table.shape, PARTIAL, dtype=torch.int8, device=self.device)
        code[table == -2] = EMPTY
        code[table == -1] = FULL
        return code[0] if self.num_heads == 1 else code

    def to_mask(self) -> Mask:
        """The layout as a :class:`Mask` (same predicate as the mask it was built from);
        cached."""
        if self._mask is None:
            self._mask = LayoutMask(self)
        return self._mask

    def dense(self, device: torch.device | str | None = None) -> Tensor:
        """``bool [L_q, L_k]`` (``[H, L_q, L_k]`` per head) element mask of the layout."""
        return self.to_mask().dense(device)


class LayoutMask(Mask):
    """A :class:`BlockLayout` read back as a mask: ``allowed(q, k, h)`` is ``True`` iff
    block ``(q // BM, k // BN)`` of head ``h`` is full, or partial with
    ``patterns[p, q % BM, k % BN]``."""

    def __init__(self, layout: BlockLayout) -> None:
        super().__init__(layout.L_q, layout.L_k, layout.num_heads)
        self.BM, self.BN = layout.BM, layout.BN
        self._graph_block_size = (layout.BM, layout.BN)
        self._table = _DeviceBuffer(layout.block_table().cpu())
        self._pattern_table = _DeviceBuffer(layout.patterns.cpu())
        self._layout_map = layout.block_map().cpu()

    def _params(self) -> str:
        return f"BM={self.BM}, BN={self.BN}"

    def _allowed(self, q, k, h):
        table = self._table.on(q.device)
        t = table[0][q // self.BM, k // self.BN] if h is None else table[h, q // self.BM, k // self.BN]
        patterns = self._pattern_table.on(q.device)
        if patterns.size(0) == 0:
            return t == -1
        in_pattern = patterns[t.clamp(min=0).long(), q % self.BM, k % self.BN]
        return (t == -1) | ((t >= 0) & in_pattern)

    def _patterns(self, h, rb, cb, BM, BN, device):
        if (BM, BN) != (self.BM, self.BN):
            return super()._patterns(h, rb, cb, BM, BN, device)
        h = h.to(device) if self.num_heads > 1 else torch.zeros_like(rb, device=device)
        pid = self._table.on(device)[h.long(), rb.to(device).long(), cb.to(device).long()].long()
        return self._pattern_table.on(device), pid

    def _block_map(self, BM, BN, device):
        if (BM, BN) == (self.BM, self.BN):
            bmap = self._layout_map.to(device)
            return bmap.unsqueeze(0) if bmap.dim() == 2 else bmap
        return self._block_map_from_elements(BM, BN, device)
