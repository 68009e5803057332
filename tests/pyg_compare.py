"""Comparing a fusegnn layer with PyG's layer of the same name (float64, CPU).

Import from any test module::

    from tests.pyg_compare import pyg_nn, requires_pyg, layer_pair, assert_same_as_pyg

* :func:`layer_pair` builds both layers with the same constructor arguments, gives PyG's
  every parameter random values (biases and attention vectors included, which their
  initialisation leaves at zero or symmetric) and copies them into fusegnn's by name
  (the names are PyG's; a ``rename`` maps the ones that differ), checking that both have
  exactly the same parameters, buffers and shapes.
* :func:`assert_same_as_pyg` runs both on independent copies of the inputs (any nesting
  of tuples; float tensors require grad), compares every output (an index tensor exactly,
  float tensors to ``1e-10``) and the gradients of every float input and parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

try:
    import torch_geometric.nn as pyg_nn

    _REASON = ""
except Exception as err:  # pragma: no cover - exercised only without PyG
    pyg_nn = None
    _REASON = f"torch_geometric is not importable ({type(err).__name__}: {err})"

requires_pyg = pytest.mark.skipif(pyg_nn is None, reason=_REASON or "torch_geometric missing")

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)

__all__ = ["pyg_nn", "requires_pyg", "randn", "layer_pair", "copy_pyg_params", "assert_same_as_pyg", "on_device"]


def randn(*shape: int, seed: int) -> Tensor:
    """A float64 ``torch.randn`` of a private generator (the global RNG is not touched)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def copy_pyg_params(theirs: nn.Module, ours: nn.Module, rename: dict[str, str] | None = None) -> None:
    """Copy PyG's parameters and buffers into ours; ``rename`` maps PyG's name to ours
    where they differ. Both must have the same entries, of the same shapes."""
    rename = rename or {}
    src = {rename.get(k, k): v for k, v in theirs.state_dict().items()}
    dst = ours.state_dict()
    assert sorted(src) == sorted(dst), f"parameters differ: PyG {sorted(src)} vs fusegnn {sorted(dst)}"
    for name, value in src.items():
        assert value.shape == dst[name].shape, f"{name}: PyG {tuple(value.shape)} vs fusegnn {tuple(dst[name].shape)}"
    ours.load_state_dict(src, strict=True)


def layer_pair(ours_cls, pyg_cls, *args, seed: int = 0, rename: dict[str, str] | None = None, **kwargs):
    """``(ours, theirs)``: both built with ``(*args, **kwargs)`` in float64 (ours on the
    reference aggregation where it takes one), PyG's parameters randomised, ours a copy."""
    torch.manual_seed(seed)
    theirs = pyg_cls(*args, **kwargs).double()
    ours = ours_cls(*args, **kwargs, **_reference(ours_cls)).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    copy_pyg_params(theirs, ours, rename)
    return ours, theirs


def _reference(cls) -> dict:
    import inspect

    return {"aggregation": "reference"} if "aggregation" in inspect.signature(cls).parameters else {}


def on_device(value, device: torch.device | str):
    """``value`` (a tensor, sparse tensor, module, :class:`fusegnn.Graph`, or any nesting of
    tuples, lists and dicts of them) moved to ``device``; other values as they are."""
    if isinstance(value, (Tensor, nn.Module)) or hasattr(value, "edge_index"):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


def _clone_inputs(value, leaves: list):
    """A copy of ``value`` whose dense float tensors are new leaves requiring grad."""
    if isinstance(value, Tensor):
        if value.layout == torch.strided and value.is_floating_point():
            leaf = value.detach().clone().requires_grad_()
            leaves.append(leaf)
            return leaf
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_clone_inputs(v, leaves) for v in value)
    if isinstance(value, dict):
        return {k: _clone_inputs(v, leaves) for k, v in value.items()}
    return value


def _flatten(value) -> list[Tensor]:
    """The tensors of an output; a sparse matrix as its index tensors and its values."""
    if isinstance(value, Tensor):
        if value.layout == torch.sparse_coo:
            return [torch.tensor(value.shape, device=value.device), value.indices(), value.values()]
        if value.layout == torch.sparse_csr:
            return [torch.tensor(value.shape, device=value.device), value.crow_indices(), value.col_indices(),
                    value.values()]
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    raise AssertionError(f"unexpected output {type(value).__name__}")


def _same_structure(a, b) -> None:
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        assert isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)), (type(a), type(b))
        assert len(a) == len(b), f"fusegnn returns {len(a)} items, PyG {len(b)}"
        for x, y in zip(a, b):
            _same_structure(x, y)
    else:
        assert isinstance(a, Tensor) and isinstance(b, Tensor), (type(a), type(b))
        assert a.layout == b.layout, f"fusegnn returns a {a.layout} tensor, PyG a {b.layout} one"


def assert_same_as_pyg(
    ours: nn.Module, theirs: nn.Module, *args, seed: int = 4, pyg_args: tuple | None = None,
    pyg_kwargs: dict | None = None, **kwargs,
):
    """Run ``ours(*args, **kwargs)`` and ``theirs(*args, **kwargs)`` (or ``theirs(*pyg_args,
    **pyg_kwargs)``, where PyG needs other inputs for the same function) on copies of the
    inputs, compare the outputs, then the gradients of every float input and parameter
    of ``sum(out * g)`` over the float outputs (a fixed random ``g`` each). Returns our output."""
    pyg_args = args if pyg_args is None else pyg_args
    pyg_kwargs = kwargs if pyg_kwargs is None else pyg_kwargs
    leaves_ours, leaves_theirs = [], []
    out1 = ours(*_clone_inputs(args, leaves_ours), **_clone_inputs(kwargs, leaves_ours))
    out2 = theirs(*_clone_inputs(pyg_args, leaves_theirs), **_clone_inputs(pyg_kwargs, leaves_theirs))
    assert len(leaves_ours) == len(leaves_theirs)
    _same_structure(out1, out2)
    loss1 = loss2 = 0.0
    for k, (a, b) in enumerate(zip(_flatten(out1), _flatten(out2))):
        assert a.shape == b.shape, f"output {k}: fusegnn {tuple(a.shape)} vs PyG {tuple(b.shape)}"
        if not a.is_floating_point():
            assert torch.equal(a, b), f"output {k} (an index tensor) differs"
            continue
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"output {k}: {m}")
        g = randn(*a.shape, seed=seed + k).to(a.device)
        loss1, loss2 = loss1 + (a * g).sum(), loss2 + (b * g).sum()
    params1, params2 = dict(ours.named_parameters()), dict(theirs.named_parameters())
    trainable = [n for n, p in params2.items() if p.requires_grad]
    wrt1 = leaves_ours + [params1[n] for n in trainable]
    wrt2 = leaves_theirs + [params2[n] for n in trainable]
    grads1 = torch.autograd.grad(loss1, wrt1, allow_unused=True)
    grads2 = torch.autograd.grad(loss2, wrt2, allow_unused=True)
    names = [f"input {k}" for k in range(len(leaves_ours))] + trainable
    for name, a, b in zip(names, grads1, grads2):
        if a is None or b is None:  # an input / parameter one side does not use at all
            other = b if a is None else a
            assert other is None or not other.any(), f"{name}: one side has no gradient, the other a nonzero one"
            continue
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad of {name}: {m}")
    return out1
