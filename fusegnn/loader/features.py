"""Per-batch rows of a node tensor (features, labels), gathered where the tensor lives.

* On the batch's device (the usual case when the features fit in GPU memory): one
  ``index_select``, no host round trip.
* In CPU memory while batches go to a GPU (features that do not fit there): the rows are
  gathered on the CPU into a **pinned** staging tensor and copied with
  ``non_blocking=True``, so the copy runs asynchronously; GPU memory then holds only the
  batch's rows. The caching host allocator reuses a staging block only after the copy
  that read it has finished, so a fresh staging tensor per batch is safe and cheap.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gather_rows"]


def gather_rows(values: Tensor, index: Tensor, device: torch.device, index_cpu: Tensor | None = None) -> Tensor:
    """``values[index]`` on ``device``.

    ``index`` is on ``device``; ``index_cpu`` may pass the same ids already on the CPU
    (one transfer shared by several tensors gathered from CPU memory)."""
    if values.device == device:
        return values.index_select(0, index)
    if index_cpu is None:
        index_cpu = index.cpu()
    if values.device.type != "cpu":
        return values.index_select(0, index_cpu.to(values.device)).to(device)
    if device.type == "cuda":
        staged = torch.empty((index_cpu.numel(), *values.shape[1:]), dtype=values.dtype, pin_memory=True)
        torch.index_select(values, 0, index_cpu, out=staged)
        return staged.to(device, non_blocking=True)
    return values.index_select(0, index_cpu).to(device)
