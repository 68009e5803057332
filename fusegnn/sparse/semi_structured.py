r"""A vector-sparse weight as an exact 2:4 matrix: Jigsaw's column reordering (issue #17).

The sparse tensor cores (``mma.sp``; cuSPARSELt and CUTLASS behind
``torch.sparse.to_sparse_semi_structured``) take a left operand with at most **2 non-zeros
in every 4 consecutive elements of a row** (2:4). A ``V``-sparse weight ``W``
(``[out, in]``, :class:`~fusegnn.sparse.vector_sparse.VectorSparse`) rarely is 2:4 as
stored, but a permutation of its *input columns* (with zero padding columns, a widened
input) can make it so, exactly, with no value dropped: ``x W^\top = x_P W_P^\top`` where
``x_P = x[:, gather]`` and ``W_P = W[:, gather]`` with the padding slots of ``W_P`` zero.

**Why vectors make it tractable.** The ``V`` rows of a row group share their columns, so
the 2:4 condition is checked on the ``[G, in]`` *vector pattern* ``P``
(:math:`G = \lceil out / V \rceil`, ``P[g, k]``: group ``g`` stores a vector in column
``k``): a set :math:`S` of 4 columns is a valid 4-slot group iff
:math:`\sum_{k \in S} P[g, k] \le 2` for every ``g``. Every row of group ``g`` then has at
most 2 non-zeros in those 4 slots, whatever the values.

**Algorithm** (:func:`semi_structured_layout`; one global order: what a single gather of
``x`` and one 2:4 matmul can use). Columns no group uses are dropped (``x`` never reads
them). The used columns are sorted by how many groups use them, densest first. Then the
4-slot groups are filled one at a time: a group opens with the densest column left; up to
3 times, among the next ``window`` columns left, those that keep every row group at
:math:`\le 2` are candidates and the one sharing the fewest row groups with the group so
far joins it (ties: the densest). Slots no candidate fills are zero padding. Each column
is a bitset over the ``G`` row groups (``uint64`` words); one step tests a window of
columns at once, so the cost is :math:`O(n_{used} \cdot window \cdot G / 64)` word
operations plus a Python step per placed column (numpy-vectorised inside). Any two
columns fit together, so every 4-slot group holds at least 2 columns: the width is at most
twice the used columns (then rounded up to ``align``, 64 by default: torch's 2:4 shapes).

**Measured widening** (``width / in``; ``W`` pruned from ``nn.Linear``'s initialisation by
:meth:`~fusegnn.sparse.VectorSparse.prune`, seed 0, ``window=1024``; the time is the
whole search on the CPU, 2 cores shared with other jobs, so an upper bound; a one-off
cost per weight):

==================  ====  ========  ========  ========
``W [out, in]``     V     sparsity  widening  time (s)
==================  ====  ========  ========  ========
4096 x 16384         8     95 %     1.000     1.4
4096 x 16384         8     90 %     1.000     1.0
4096 x 16384         8     80 %     1.203     1.5
4096 x 16384         8     70 %     1.934     1.5
4096 x 16384         8     50 %     2.000     2.8
4096 x 16384         4     90 %     1.004     1.9
4096 x 16384        16     90 %     1.000     1.2
16384 x 4096         8     95 %     1.016     0.6
16384 x 4096         8     90 %     1.016     0.8
16384 x 4096         8     80 %     2.000     0.7
16384 x 4096         4     90 %     1.281     1.1
16384 x 4096        16     90 %     1.016     0.5
==================  ====  ========  ========  ========

(1.016 at ``in = 4096`` is one alignment block of 64 padding slots; the ``vector``
benchmark suite names cases ``linear-{in}x{out}``, so its ``linear-4096x16384-s90-v8`` is
``W [16384, 4096]`` here.) A wider ``window``
fills more groups at a proportional cost: 4096 x 16384, V = 8, 80 %: widening 1.289 /
1.203 / 1.129 at ``window`` 256 / 1024 / 4096. Fewer row groups (``out / V``) and
sparser weights fit better: a 4-slot group fails a row group that uses 3 of its columns.

**What it can and cannot do.** The 2:4 weight has ``out x width / 2`` stored values
whatever the V-sparsity: a 90 %-sparse weight reordered without widening is still 50 %
dense in 2:4 form, so the 2:4 product does half a dense product's work at best (at
``width = in``; torch's cuSPARSELt 2:4 matmul measured 0.81-1.01x of dense at 8192 cubed
and 1.27-1.36x at 16384 cubed, bf16, on the H100), against ``1 - sparsity`` for :func:`~fusegnn.sparse.vspmm`. The only
compaction one global order allows is dropping the columns *no* row group uses; at 90 %
sparsity over hundreds of row groups there are none. Jigsaw compacts per block of rows
(``BLOCK_TILE``: each row block drops its own empty columns and has its own reordering),
which needs a gather of ``x`` per row block inside the kernel -- not expressible with one
``to_sparse_semi_structured`` matmul, so this module does not do it. When the greedy
cannot fill the groups (denser weights, many row groups), the width grows towards twice
the used columns, and the 2:4 form is no smaller than the dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fusegnn.sparse.graph import type_name
from fusegnn.sparse.vector_sparse import VectorSparse

__all__ = [
    "SEMI_STRUCTURED_DTYPES",
    "SemiStructuredLayout",
    "is_2_4",
    "semi_structured_layout",
    "to_semi_structured",
    "vector_pattern",
]

#: the dtypes torch's 2:4 matmul runs for floating weights
SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)
#: row multiple torch's 2:4 tensors need (CUTLASS: 32, cuSPARSELt: 16); rows are zero-padded
ROW_ALIGN = 32
#: column multiple torch's 2:4 tensors need (CUTLASS: 64, cuSPARSELt: 16)
COLUMN_ALIGN = 64


def _describe(value: object) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, Tensor) else type_name(value)


@dataclass(frozen=True)
class SemiStructuredLayout:
    r"""Where each input column goes in the widened, 2:4-compatible input.

    * ``perm`` (``int64 [in_features]``): a permutation of the input columns: the used
      columns in slot order, then the dropped (empty) ones;
    * ``slots`` (``int64 [num_used]``, increasing): the slot (position in ``[0, width)``)
      of column ``perm[i]``; the other slots are zero padding;
    * ``width``: the widened input dimension (a multiple of 4 and of ``align``).

    ``gather`` is the one index ``x`` is read through (padding slots read ``perm[0]``,
    multiplied by a zero weight); :meth:`permute_weight` gives ``W_P`` with
    :math:`x W^\top = x[:, gather]\, W_P^\top`.
    """

    perm: Tensor
    slots: Tensor
    width: int
    in_features: int

    @property
    def num_used(self) -> int:
        return self.slots.numel()

    @property
    def widening(self) -> float:
        """``width / in_features``."""
        return self.width / max(self.in_features, 1)

    @property
    def gather(self) -> Tensor:
        """``int64 [width]``: the input column each slot reads."""
        index = torch.full((self.width,), int(self.perm[0]) if self.perm.numel() else 0, dtype=torch.int64,
                           device=self.perm.device)
        index[self.slots] = self.perm[: self.num_used]
        return index

    def to(self, device: torch.device | str) -> "SemiStructuredLayout":
        return SemiStructuredLayout(self.perm.to(device), self.slots.to(device), self.width, self.in_features)

    def permute_weight(self, weight: Tensor) -> Tensor:
        """``W_P`` (``[out, width]``): ``weight``'s used columns at their slots, zero
        elsewhere. ``weight`` must be zero in the dropped columns (no value is lost)."""
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.size(1) != self.in_features:
            raise ValueError(f"weight must be [out, {self.in_features}], got {_describe(weight)}")
        perm = self.perm.to(weight.device)
        dropped = perm[self.num_used:]
        if dropped.numel() and bool((weight.index_select(1, dropped) != 0).any()):
            raise ValueError("weight has non-zeros in columns the layout drops (a different pattern?)")
        out = weight.new_zeros(weight.size(0), self.width)
        out[:, self.slots.to(weight.device)] = weight.index_select(1, perm[: self.num_used])
        return out


def vector_pattern(matrix: VectorSparse) -> Tensor:
    """Boolean ``[G, K]``: ``True`` where row group ``g`` stores a vector in column ``k``."""
    if not isinstance(matrix, VectorSparse):
        raise TypeError(f"matrix must be a VectorSparse, got {type_name(matrix)}")
    pattern = torch.zeros(matrix.num_groups, matrix.shape[1], dtype=torch.bool, device=matrix.device)
    pattern[matrix.vector_groups(), matrix.col_idx.long()] = True
    return pattern


def is_2_4(matrix: Tensor) -> bool:
    """Whether every row of ``matrix`` (``[rows, cols]``, ``cols`` a multiple of 4) has at
    most 2 non-zeros in each 4 consecutive columns ``4j .. 4j + 3``."""
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        raise ValueError(f"matrix must be a 2-D tensor, got {_describe(matrix)}")
    rows, cols = matrix.shape
    if cols % 4:
        raise ValueError(f"matrix must have a multiple of 4 columns, got {cols}")
    return bool(((matrix != 0).reshape(rows, cols // 4, 4).sum(-1) <= 2).all())


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(words)
    table = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
    return table[words.view(np.uint8)].reshape(*words.shape, 8).sum(-1)


def _column_bits(pattern: np.ndarray) -> np.ndarray:
    """``uint64 [K, ceil(G / 64)]``: column ``k``'s row groups as a bitset."""
    packed = np.packbits(pattern.T, axis=1, bitorder="little")  # [K, ceil(G / 8)]
    pad = (-packed.shape[1]) % 8
    if pad or packed.shape[1] == 0:
        packed = np.pad(packed, ((0, 0), (0, pad or 8)))
    return np.ascontiguousarray(packed).view(np.uint64)


def _fill_groups(bits: np.ndarray, order: np.ndarray, window: int) -> list[list[int]]:
    """The greedy of the module docstring: 4-slot groups of columns (``order``: the used
    columns, densest first)."""
    remaining = order
    groups: list[list[int]] = []
    while remaining.size:
        members = [int(remaining[0])]
        remaining = remaining[1:]
        once = bits[members[0]].copy()
        twice = np.zeros_like(once)
        for _ in range(3):
            if not remaining.size:
                break
            candidates = bits[remaining[:window]]  # [w, words]
            fits = ~(candidates & twice).any(axis=1)
            if not fits.any():
                break
            shared = _popcount(candidates & once).sum(axis=1, dtype=np.int64)
            shared[~fits] = np.iinfo(np.int64).max
            pick = int(np.argmin(shared))  # the first minimum: the densest of the least shared
            column = bits[remaining[pick]]
            twice |= once & column
            once |= column
            members.append(int(remaining[pick]))
            remaining = np.delete(remaining, pick)
        groups.append(members)
    return groups


def semi_structured_layout(
    pattern: Tensor, *, align: int = COLUMN_ALIGN, window: int = 1024
) -> SemiStructuredLayout:
    r"""The column layout making a weight of vector pattern ``pattern`` (boolean
    ``[G, in]``, :func:`vector_pattern`) exactly 2:4 (module docstring: algorithm, cost,
    widening). ``align``: the width is a multiple of it (and of 4); ``window``: how many
    of the columns left each step considers (larger: fuller groups, slower). Computed on
    the host; the tensors are on ``pattern``'s device."""
    if not isinstance(pattern, Tensor) or pattern.dim() != 2 or pattern.dtype != torch.bool:
        raise ValueError(f"pattern must be a boolean [row groups, in_features] tensor, got {_describe(pattern)}")
    for name, value in (("align", align), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    host = pattern.cpu().numpy()
    K = host.shape[1]
    counts = host.sum(axis=0)
    used = np.flatnonzero(counts)
    order = used[np.argsort(-counts[used], kind="stable")]
    groups = _fill_groups(_column_bits(host), order, window)
    slots = np.concatenate([4 * g + np.arange(len(m)) for g, m in enumerate(groups)] or [np.zeros(0, np.int64)])
    columns = np.concatenate([np.asarray(m, dtype=np.int64) for m in groups] or [np.zeros(0, np.int64)])
    perm = np.concatenate([columns, np.flatnonzero(counts == 0)])
    multiple = int(np.lcm(4, align))
    width = max(-(-4 * len(groups) // multiple) * multiple, multiple)
    device = pattern.device
    return SemiStructuredLayout(torch.from_numpy(perm.astype(np.int64)).to(device),
                                torch.from_numpy(slots.astype(np.int64)).to(device), width, K)


def to_semi_structured(weight: Tensor) -> Tensor:
    """``torch.sparse.to_sparse_semi_structured`` of a 2:4 ``weight`` (``[out, width]``,
    float16 / bfloat16, CUDA), its rows zero-padded to a multiple of 32 (torch's shapes):
    the result has ``ceil(out / 32) * 32`` rows; slice the product's columns to ``out``."""
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got {_describe(weight)}")
    if weight.dtype not in SEMI_STRUCTURED_DTYPES:
        raise TypeError(
            f"the 2:4 form needs a float16 or bfloat16 weight (torch's semi-structured matmul), "
            f"got dtype {weight.dtype}"
        )
    if weight.device.type != "cuda":
        raise RuntimeError(
            f"the 2:4 form needs a CUDA weight: torch builds semi-structured tensors (cuSPARSELt / CUTLASS) "
            f"on CUDA only, got device {weight.device}"
        )
    if weight.size(1) % COLUMN_ALIGN:
        raise ValueError(f"weight must have a multiple of {COLUMN_ALIGN} columns, got {weight.size(1)}")
    if not is_2_4(weight):
        raise ValueError("weight is not 2:4 (more than 2 non-zeros in some 4 consecutive columns of a row)")
    pad = (-weight.size(0)) % ROW_ALIGN
    padded = torch.cat([weight, weight.new_zeros(pad, weight.size(1))]) if pad else weight
    return torch.sparse.to_sparse_semi_structured(padded.contiguous())
