r"""The halo exchange: owned rows out to the workers that aggregate them, halo rows in.

Forward, on worker ``r`` with owned rows ``x`` ``[n_own, ...]``:

.. math::
    \mathrm{out} = \begin{bmatrix} x \\ \mathrm{recv} \end{bmatrix}, \qquad
    \mathrm{recv}_{q\text{'s block}} = x^{(q)}[\mathrm{send}^{(q \to r)}]

one ``torch.distributed.all_to_all_single`` with the split sizes of the send and receive
lists (:class:`~fusegnn.distributed.dist_graph.DistGraph`). Backward, the transpose: the
gradient rows of the halo go back to their owners (the same collective with the splits
swapped), which add them to their own rows' gradient at the sent positions
(``index_add``), so the gradient is exact: every use of a row, on any worker, contributes.

It runs on any backend that has ``all_to_all_single``: NCCL on CUDA tensors, gloo on
CPU tensors. With one worker it is the identity and no collective runs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["halo_exchange", "HaloExchange", "HaloExchangeTranspose"]


def halo_exchange(x_owned: Tensor, dist_graph) -> Tensor:
    """``[n_own, ...]`` owned rows -> ``[n_own + n_halo, ...]`` rows of every local source
    (owned, then halo), differentiable (see the module docstring). A collective: every
    worker of ``dist_graph``'s group calls it together."""
    if not isinstance(x_owned, Tensor):
        raise TypeError(f"x_owned must be a torch.Tensor, got {type(x_owned).__name__}")
    if x_owned.dim() == 0 or x_owned.size(0) != dist_graph.num_own:
        raise ValueError(f"x_owned must have {dist_graph.num_own} rows (the owned nodes), got {tuple(x_owned.shape)}")
    if dist_graph.world_size == 1:
        return x_owned
    return HaloExchange.apply(x_owned, dist_graph)


def _all_to_all(rows: Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """``all_to_all_single`` of the 2-D ``rows`` (``in_splits`` rows to each rank) into a
    new ``[out_rows, width]`` tensor (``out_splits`` rows from each rank)."""
    out = rows.new_empty((out_rows, rows.size(1)))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class HaloExchange(torch.autograd.Function):
    """``apply(x_owned, dist_graph)``: the exchange as one autograd node."""

    @staticmethod
    def forward(ctx, x_owned: Tensor, dist_graph) -> Tensor:  # type: ignore[override]
        n_own, rest = x_owned.size(0), x_owned.shape[1:]
        width = math.prod(rest)
        flat = x_owned.reshape(n_own, width)
        send = flat.index_select(0, dist_graph.send_index)
        out = flat.new_empty((n_own + dist_graph.num_halo, width))
        out[:n_own].copy_(flat)
        # the halo rows arrive in place, after the owned ones (a row range is contiguous)
        dist.all_to_all_single(out[n_own:], send, output_split_sizes=dist_graph.recv_counts,
                               input_split_sizes=dist_graph.send_counts, group=dist_graph.group)
        dist_graph.log.record(send.size(0), dist_graph.num_halo, width * x_owned.element_size(), "forward")
        ctx.dist_graph = dist_graph
        return out.reshape(n_own + dist_graph.num_halo, *rest)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return HaloExchangeTranspose.apply(grad, ctx.dist_graph), None


class HaloExchangeTranspose(torch.autograd.Function):
    """``apply(grad_rows, dist_graph)``: the exchange's transpose, ``[n_own + n_halo, ...]``
    -> ``[n_own, ...]``: the halo rows go back to their owners, which add them at the sent
    positions. The backward of :class:`HaloExchange`, and differentiable in turn (its own
    backward is the exchange), so second derivatives see the cross-worker terms too."""

    @staticmethod
    def forward(ctx, grad: Tensor, dist_graph) -> Tensor:  # type: ignore[override]
        dg = dist_graph
        n_own, rest = dg.num_own, grad.shape[1:]
        flat = grad.reshape(n_own + dg.num_halo, math.prod(rest))
        back = _all_to_all(flat[n_own:], dg.send_index.numel(), dg.send_counts, dg.recv_counts, dg.group)
        dg.log.record(flat.size(0) - n_own, back.size(0), flat.size(1) * grad.element_size(), "backward")
        grad_owned = flat[:n_own].index_add(0, dg.send_index, back)
        ctx.dist_graph = dg
        return grad_owned.reshape(n_own, *rest)

    @staticmethod
    def backward(ctx, grad_owned: Tensor):  # type: ignore[override]
        return HaloExchange.apply(grad_owned, ctx.dist_graph), None
