r"""Capture a whole training step into a CUDA graph and replay it.

On a small graph (Cora: 2,708 nodes) a training step is a few dozen tiny kernels, and
the time goes into launching them from Python, not into running them. A CUDA graph
records the step's kernels once and replays them with one launch, so the step costs
what the GPU work costs. :func:`graphed_step` wraps a step function the way a training
loop writes it::

    import fusegnn
    from fusegnn.models import GCN

    model = GCN(dataset.num_features, 16, dataset.num_classes).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    graph = dataset.graph                               # one Graph, built once
    train_index = dataset.train_mask.nonzero().view(-1)  # indices, not a boolean mask

    @fusegnn.graphed_step(optimizer=optimizer)
    def train_step(x, y):
        out = model(x, graph)
        loss = F.cross_entropy(out.index_select(0, train_index), y.index_select(0, train_index))
        loss.backward()
        optimizer.step()
        return loss

    for epoch in range(200):
        loss = train_step(dataset.x, dataset.y)   # a static tensor: no sync unless read
        ...
        print(loss.item())                        # reading it syncs, as usual

**Every call is one training step.** The first ``warmup`` calls (default 3) run the
function eagerly, on a side stream: they build what fusegnn computes on the first use of
a graph and caches on it (CSR / CSC, GAR segment plans, GAT chunk schedules, GCN's
normalised graph -- work that reads sizes back to the host, which a graph cannot
record), compile the Triton kernels and create the optimizer state. The next call
captures the step with :func:`torch.cuda.graph` and replays it once; every later call
copies its inputs into the captured buffers if needed and replays.

**Inputs.** Tensor arguments are copied into static buffers owned by the step (a replay
reads fixed addresses). A call with the very tensor of the previous call, unmodified
since (same ``_version``), copies nothing; a different tensor, or one changed in place,
is copied, and must have the captured shape, dtype and device. Other arguments (a
:class:`~fusegnn.sparse.Graph`, a number) are part of the recording: later calls must pass
the same object (or an equal value). Tensors the function reads from its closure (the
model's parameters, ``train_index`` above) are read at their addresses on every replay:
change them in place (``copy_``), never rebind them.

**Outputs** (a tensor, or a tuple / list / dict of them) are detached. From the capture
on they are the same tensors at every call, overwritten by the next replay: ``clone()``
what you keep. Nothing is synchronised unless you read a value.

**Gradients.** Before each warm-up call and before the capture, the gradients of the
optimizer's parameters are set to ``None``, so the captured backward *writes* fresh
gradients instead of accumulating: a step needs no ``zero_grad`` of its own (one inside
it is harmless).

**Optimizer.** torch refuses to capture ``optimizer.step()`` unless its param groups are
``capturable``: Adam's default keeps its step counter on the host and reads it in every
step, a value a replay could not advance. :func:`graphed_step` switches ``capturable`` on
for every group that has the option (Adam, AdamW, NAdam, RAdam, Adamax, ...) and moves
existing step counters (and NAdam's ``mu_product``) to the device: the same update, computed on the device
(identical up to rounding). Hyper-parameters given as Python numbers (``lr``, ``betas``,
``weight_decay``) are baked into the recording; changing one after the capture raises
an error at the next call rather than being silently ignored. For a schedule, give a
tensor learning rate (``lr=torch.tensor(0.01, device="cuda")`` with ``capturable=True``;
torch's schedulers update it in place) or call :meth:`GraphedStep.reset` to capture again.

**Fused optimizer kernel.** Adam and AdamW groups that left the implementation to torch
(neither ``foreach`` nor ``fused`` given) are switched to torch's fused CUDA kernel
(``fused=True``): one launch updates every parameter, where the default multi-tensor
(``foreach``) update with ``capturable`` is about 16 launches and a dozen elementwise
kernels. Inside a replay the launches are the cost: on an H100 the captured Cora steps of
GCN, SAGE and GIN run 1.8-2.0x faster with it, PubMed's 1.4-1.6x
(``benchmarks/NOTES-overhead.md``, session 13). The update is Adam's, computed in another
order (equal up to rounding). ``fuse_optimizer=False`` keeps the optimizer as built; a
group that set ``foreach`` or ``fused`` itself is never changed.

**Randomness.** Random numbers are drawn by kernels from torch's CUDA generator, which a
captured graph advances at every replay: ``F.dropout`` and fusegnn's fused GAT attention
dropout (its seed is drawn by ``torch.randint`` on the device) draw a new mask at every
step, and ``torch.manual_seed`` still makes a run reproducible.

**What cannot be captured** is anything that reads a device value back to the host in
every step: ``loss.item()`` inside the step, boolean-mask indexing (``out[mask]``: the
size of the result is data-dependent), a :class:`~fusegnn.sparse.Graph` built inside the
step (its ids are validated), graph processing that is redone on every call instead of
cached on the graph (PyG's ``GATConv`` removes and re-adds self-loops with boolean
masks in every call). While capturing, synchronising CUDA operations are made errors
(:func:`torch.cuda.set_sync_debug_mode`), so the capture stops at the offending line and
:class:`CaptureError` names it. An optimizer that keeps state on the host for CUDA
parameters (Adagrad's step counter) is refused before the capture: a replay could
never update it.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fusegnn._tensor_tree import map_tensors
from fusegnn.sparse.dispatch import for_capture

__all__ = ["graphed_step", "GraphedStep", "CaptureError"]

#: Eager calls before the capture by default (PyTorch's whole-network capture example
#: warms up three iterations; fusegnn needs one to build its per-graph caches).
DEFAULT_WARMUP = 3

_CAPTURABLE_WARNING = r"This instance was constructed with capturable=True"

#: one side stream per device for every GraphedStep's warm-ups and capture. Sharing it
#: matters for memory: cuBLAS keeps a workspace per (handle, stream) for the rest of the
#: process (32 MiB on Hopper, and a handle per thread: the caller's and the autograd
#: engine's), so a stream per step kept 64 MiB more alive with every step captured.
#: torch.cuda.graph shares its default capture stream the same way.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (created at first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


class CaptureError(RuntimeError):
    """A step could not be captured into a CUDA graph; the message says where and why.

    Raised from the call that attempts the capture. The model and the optimizer state are
    as before that call (a capture records kernels without running them); the gradients
    of the optimizer's parameters are ``None``.

    Attributes:
        filename, lineno, function: where it failed: the innermost frame outside torch
            (``None`` when no Python frame was recorded).
        reason: the first line of the original error.
        synchronised: whether the step tried to synchronise with the host (the usual
            cause: ``.item()``, boolean-mask indexing, ...).
    """

    def __init__(self, message: str, *, filename: str | None = None, lineno: int | None = None,
                 function: str | None = None, reason: str = "", synchronised: bool = False) -> None:
        super().__init__(message)
        self.filename = filename
        self.lineno = lineno
        self.function = function
        self.reason = reason
        self.synchronised = synchronised

    @property
    def location(self) -> str | None:
        """``"torch_geometric/utils/loop.py:97 in remove_self_loops()"``, or ``None``."""
        if self.filename is None:
            return None
        return f"{_shorten(self.filename)}:{self.lineno} in {self.function}()"

    @property
    def summary(self) -> str:
        """One short line: ``"host sync in remove_self_loops() (loop.py:97)"``."""
        what = "host sync" if self.synchronised else self.reason
        if self.filename is None:
            return what
        return f"{what} in {self.function}() ({Path(self.filename).name}:{self.lineno})"


def graphed_step(
    fn: Callable[..., Any] | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    warmup: int = DEFAULT_WARMUP,
    fuse_optimizer: bool = True,
) -> GraphedStep | Callable[[Callable[..., Any]], GraphedStep]:
    """Wrap a training step so that it runs as a replayed CUDA graph (see the module
    docstring for the semantics).

    Args:
        fn: the step: forward, loss, ``loss.backward()``, ``optimizer.step()``; returns
            what the caller wants back (usually the loss). Omit it to use
            ``graphed_step(optimizer=...)`` as a decorator.
        optimizer: the optimizer(s) that ``fn`` steps. Their groups are made
            ``capturable`` and their parameters' gradients are reset before the capture;
            ``None`` for a step without an optimizer (gradients are then ``fn``'s
            business).
        warmup: eager calls before the capture, at least 1.
        fuse_optimizer: switch Adam / AdamW groups that chose no implementation to
            torch's fused kernel (see the module docstring); ``False`` leaves them.

    Returns:
        a :class:`GraphedStep`, called like ``fn``.

    Raises:
        TypeError: ``fn`` is not callable, ``optimizer`` is not an optimizer, or
            ``fuse_optimizer`` is not a bool.
        ValueError: ``warmup < 1``, or a parameter of ``optimizer`` is not on a CUDA device.
    """
    if fn is None:
        return functools.partial(_decorate, optimizer=optimizer, warmup=warmup, fuse_optimizer=fuse_optimizer)
    return GraphedStep(fn, optimizer, warmup=warmup, fuse_optimizer=fuse_optimizer)


def _decorate(fn: Callable[..., Any], *, optimizer, warmup: int, fuse_optimizer: bool) -> GraphedStep:
    return GraphedStep(fn, optimizer, warmup=warmup, fuse_optimizer=fuse_optimizer)


class GraphedStep:
    """A step function captured into a CUDA graph on its ``warmup + 1``-th call and
    replayed from then on. Build it with :func:`graphed_step`.

    Attributes:
        fn: the wrapped step function.
        optimizers: the optimizers it steps (empty tuple for none).
        warmup: eager calls before the capture.
        fuse_optimizer: whether Adam / AdamW groups are switched to torch's fused kernel.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        warmup: int = DEFAULT_WARMUP,
        fuse_optimizer: bool = True,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"graphed_step: fn must be callable, got {type(fn).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"graphed_step: warmup must be an int >= 1, got {warmup!r} (the first call must run "
                "eagerly: it builds the graph's cached formats and the optimizer state, which a "
                "capture cannot do)"
            )
        if not isinstance(fuse_optimizer, bool):
            raise TypeError(f"graphed_step: fuse_optimizer must be a bool, got {type(fuse_optimizer).__name__}")
        self.fn = fn
        self.optimizers = _as_optimizers(optimizer)
        self.warmup = warmup
        self._name = getattr(fn, "__qualname__", type(fn).__name__)
        functools.update_wrapper(self, fn, updated=())
        self._names = _parameter_names(fn)
        self._device = self._optimizer_device()
        self.fuse_optimizer = fuse_optimizer
        self._prepare_optimizers()
        self._eager_calls = 0
        self._stream: torch.cuda.Stream | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._spec: _CallSpec | None = None
        self._outputs: Any = None
        self._hyper: list[tuple[dict, str, Any]] = []
        self._num_groups: list[int] = []
        self._captured_state: list[tuple[list, dict]] = []
        self._host_hyper: list[tuple[dict, str, Tensor, Tensor]] = []
        self._device_hyper: list[tuple[dict, str, Tensor]] = []

    # ------------------------------------------------------------------ public
    @property
    def captured(self) -> bool:
        """Whether the step has been captured (later calls replay it)."""
        return self._graph is not None

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured :class:`torch.cuda.CUDAGraph` (``None`` before the capture)."""
        return self._graph

    def reset(self) -> None:
        """Drop the captured graph and its buffers: the next calls warm up and capture
        again (after changing a hyper-parameter, loading the optimizer's state, or to
        capture other shapes). The optimizers are prepared again (``capturable``, and the
        fused kernel with ``fuse_optimizer``): a loaded state may have come from an
        optimizer without them."""
        self._prepare_optimizers()
        self._graph = None
        self._spec = None
        self._outputs = None
        self._hyper = []
        self._num_groups = []
        self._captured_state = []
        self._host_hyper = []
        self._device_hyper = []
        self._eager_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._graph is not None:
            self._spec.load(args, kwargs)
            self._check_optimizers()
            self._graph.replay()
            return self._outputs
        device = _check_call(args, kwargs, self._names, self._device, self._name)
        with torch.cuda.device(device):
            if self._stream is None:
                self._stream = _side_stream(device)
            if self._eager_calls < self.warmup - 1:
                out = self._eager(args, kwargs)
            elif self._spec is None:
                # The last warm-up call runs on the static buffers the capture will use, so
                # that anything cached per input tensor is cached for those.
                self._spec = _CallSpec(args, kwargs, self._names, self._name)
                out = self._eager(*self._spec.static_call())
            else:
                self._spec.load(args, kwargs)
                return self._capture()
            self._eager_calls += 1
            return out

    def __repr__(self) -> str:
        state = "captured" if self.captured else f"{self._eager_calls}/{self.warmup} warm-up calls done"
        return f"GraphedStep({self._name}, {state})"

    # ------------------------------------------------------------------ phases
    def _zero_grads(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        """One eager step on the side stream the capture will use."""
        self._zero_grads()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        # for_capture: the warm-up runs (and builds the caches of) the paths the capture records
        with torch.cuda.stream(self._stream), warnings.catch_warnings(), for_capture():
            # torch warns that capturable=True is slower when not captured: it will be.
            warnings.filterwarnings("ignore", message=_CAPTURABLE_WARNING)
            out = _detach(self.fn(*args, **kwargs))
        current.wait_stream(self._stream)
        for tensor in _tensors(out):  # used on the caller's stream from now on
            tensor.record_stream(current)
        return out

    def _capture(self) -> Any:
        """Record the step into a CUDA graph, then replay it once (this call's step)."""
        static_args, static_kwargs = self._spec.static_call()
        for opt in self.optimizers:
            _check_optimizer_state(opt, self._name)
        self._zero_grads()  # the captured backward then writes (not adds to) the gradients
        graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.graph(graph, stream=self._stream), for_capture():
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out = _detach(self.fn(*static_args, **static_kwargs))
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
        except Exception as err:  # noqa: BLE001 - re-raised with the diagnosis
            self._zero_grads()  # gradients of a discarded recording
            raise _diagnose(err, self._name) from err
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        self._graph, self._outputs = graph, out
        self._snapshot_optimizers()
        graph.replay()
        return out

    # ------------------------------------------------------------------ optimizer checks
    def _prepare_optimizers(self) -> None:
        for opt in self.optimizers:
            _make_capturable(opt)
            if self.fuse_optimizer:
                _use_fused_implementation(opt)

    def _optimizer_device(self) -> torch.device | None:
        device = None
        for k, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                for p, param in enumerate(group["params"]):
                    where = f"parameter {p} of param group {g} of optimizer {k} (shape {tuple(param.shape)})"
                    device = _same_cuda_device(param, device, where, self._name)
        return device

    def _snapshot_optimizers(self) -> None:
        """Remember what the recording baked in: the hyper-parameters given as numbers, the
        values of those given as CPU tensors (read on the host when captured), the device
        tensors themselves (read at their addresses), and the optimizer's ``param_groups``
        and ``state`` objects (whose tensors the replays update)."""
        self._hyper, self._host_hyper, self._device_hyper = [], [], []
        for opt in self.optimizers:
            for group in opt.param_groups:
                for key, value in group.items():
                    if key == "params":
                        continue
                    if not isinstance(value, Tensor):
                        self._hyper.append((group, key, value))
                    elif value.device.type == "cpu":
                        self._host_hyper.append((group, key, value, value.detach().clone()))
                    else:
                        self._device_hyper.append((group, key, value))
        self._num_groups = [len(opt.param_groups) for opt in self.optimizers]
        self._captured_state = [(opt.param_groups, opt.state) for opt in self.optimizers]

    def _check_optimizers(self) -> None:
        for opt, (groups, state) in zip(self.optimizers, self._captured_state):
            if opt.param_groups is not groups or opt.state is not state:
                raise RuntimeError(
                    f"graphed_step({self._name}): the optimizer's param groups or state were replaced after "
                    "the step was captured (load_state_dict?); the replays would keep updating the captured "
                    "state. Call .reset() to capture again with the new state"
                )
        for group, key, value in self._hyper:
            now = group.get(key)
            if now is not value and now != value:
                raise RuntimeError(
                    f"graphed_step({self._name}): the optimizer's {key!r} changed from {value!r} to "
                    f"{now!r} after the step was captured; the recording keeps the old value. Call "
                    ".reset() to capture again, or give the optimizer a tensor (lr=torch.tensor(..., "
                    "device='cuda')) and change it in place"
                )
        for group, key, value, captured in self._host_hyper:
            now = group.get(key)
            if now is not value or not torch.equal(now, captured):
                raise RuntimeError(
                    f"graphed_step({self._name}): the optimizer's {key!r}, a CPU tensor, changed from "
                    f"{captured.tolist()!r} after the step was captured; the recording read its value on the "
                    f"host and keeps it. Put it on the GPU ({key}=torch.tensor(..., device='cuda')) to change "
                    "it between replays, or call .reset() to capture again"
                )
        for group, key, value in self._device_hyper:
            now = group.get(key)
            if now is not value:
                raise RuntimeError(
                    f"graphed_step({self._name}): the optimizer's {key!r}, a {value.device.type} tensor, was "
                    f"replaced by {_short(now)} after the step was captured; the replays keep reading the "
                    f"captured tensor. Change it in place ({key}.fill_(...), as torch's LR schedulers do) or "
                    "call .reset() to capture again"
                )
        for opt, count in zip(self.optimizers, self._num_groups):
            if len(opt.param_groups) != count:
                raise RuntimeError(
                    f"graphed_step({self._name}): a param group was added to the optimizer after the "
                    "step was captured; its parameters are not in the recording. Call .reset() to "
                    "capture again"
                )


# ---------------------------------------------------------------------- inputs
class _CallSpec:
    """The arguments a step was captured with: static buffers for tensors, the objects
    themselves for the rest; :meth:`load` puts a later call's arguments in place."""

    def __init__(self, args: tuple, kwargs: dict, names: list[str], fn_name: str) -> None:
        self.fn_name = fn_name
        self.num_args = len(args)
        self.keys = tuple(kwargs)
        self.names = [_arg_name(names, k) for k in range(len(args))] + [repr(k) for k in kwargs]
        values = [*args, *kwargs.values()]
        # a private copy: replays copy later inputs into it, never into the caller's tensor
        self.values = [v.detach().clone() if isinstance(v, Tensor) else v for v in values]
        self.sources = [
            (weakref.ref(v), v._version) if isinstance(v, Tensor) else None for v in values
        ]

    def static_call(self) -> tuple[tuple, dict]:
        args = tuple(self.values[: self.num_args])
        kwargs = dict(zip(self.keys, self.values[self.num_args :]))
        return args, kwargs

    def load(self, args: tuple, kwargs: dict) -> None:
        """Check a call's arguments against the captured ones, then copy its tensors into
        the static buffers (skipping the tensor of the last call if unchanged since).
        Nothing is copied when an argument is refused."""
        if len(args) != self.num_args or set(kwargs) != set(self.keys):
            raise TypeError(
                f"graphed_step({self.fn_name}): called with {len(args)} positional arguments and "
                f"keywords {sorted(kwargs)}, but captured with {self.num_args} and {sorted(self.keys)}"
            )
        values = (*args, *(kwargs[key] for key in self.keys)) if self.keys else args
        copies = []
        for k, new in enumerate(values):
            old = self.values[k]
            if isinstance(old, Tensor):
                source = self.sources[k]
                if source is not None and source[0]() is new and new._version == source[1]:
                    continue  # the tensor of the last call, unchanged: already in the buffer
                self._check_tensor(k, old, new)
                copies.append(k)
            elif new is not old and not _equal(new, old):
                raise ValueError(
                    f"graphed_step({self.fn_name}): argument {self.names[k]} is not the object the step "
                    f"was captured with ({_short(new)} vs {_short(old)}); only tensor arguments can "
                    "change between replays. Build another graphed_step for another graph or setting"
                )
        for k in copies:
            self.values[k].copy_(values[k])
            self.sources[k] = (weakref.ref(values[k]), values[k]._version)

    def _check_tensor(self, k: int, static: Tensor, new: Any) -> None:
        if not isinstance(new, Tensor):
            raise TypeError(
                f"graphed_step({self.fn_name}): argument {self.names[k]} was a tensor when the step was "
                f"captured, got {type(new).__name__}"
            )
        if new.shape != static.shape or new.dtype != static.dtype or new.device != static.device:
            raise ValueError(
                f"graphed_step({self.fn_name}): argument {self.names[k]} is {_describe_tensor(new)} but "
                f"the step was captured with {_describe_tensor(static)}; a CUDA graph replays fixed "
                "shapes, dtypes and devices (build another graphed_step for other shapes)"
            )
        if new.requires_grad:
            raise ValueError(_requires_grad_message(self.fn_name, self.names[k]))


def _check_call(args: tuple, kwargs: dict, names: list[str], device: torch.device | None,
                fn_name: str) -> torch.device:
    """Validate a call made before the capture; returns the CUDA device of the step."""
    items = [(_arg_name(names, k), v) for k, v in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    for name, value in items:
        if isinstance(value, Tensor):
            device = _same_cuda_device(value, device, f"argument {name}", fn_name)
            if value.requires_grad:
                raise ValueError(_requires_grad_message(fn_name, name))
        elif _contains_tensor(value):
            raise TypeError(
                f"graphed_step({fn_name}): argument {name} holds tensors inside a "
                f"{type(value).__name__}; pass each tensor as an argument of its own (only top-level "
                "tensor arguments get static buffers)"
            )
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"graphed_step({fn_name}): CUDA graphs need a CUDA device, and torch.cuda.is_available() "
                "is False; run the step eagerly on the CPU"
            )
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _same_cuda_device(tensor: Tensor, device: torch.device | None, where: str, fn_name: str) -> torch.device:
    if tensor.device.type != "cuda":
        raise ValueError(
            f"graphed_step({fn_name}): {where} is on {tensor.device}; a CUDA graph captures CUDA work "
            "only: move the model and the data to a CUDA device (or train eagerly on the CPU)"
        )
    if device is not None and tensor.device != device:
        raise ValueError(
            f"graphed_step({fn_name}): {where} is on {tensor.device} but the step's other tensors are "
            f"on {device}; a captured step runs on one device"
        )
    return tensor.device


def _requires_grad_message(fn_name: str, name: str) -> str:
    return (
        f"graphed_step({fn_name}): argument {name} requires grad; a step argument is copied into a "
        "static buffer, so its gradient would never reach it. Keep learnable tensors in the model "
        "(and the optimizer), not in the step's arguments"
    )


def _contains_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_contains_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_tensor(v) for v in value.values())
    return False


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable objects are different
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe_tensor(t: Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def _parameter_names(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s positional parameters (for error messages)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _arg_name(names: list[str], k: int) -> str:
    return repr(names[k]) if k < len(names) else f"#{k}"


# ---------------------------------------------------------------------- outputs
def _detach(value: Any) -> Any:
    return map_tensors(value, Tensor.detach)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


# ---------------------------------------------------------------------- optimizers
def _as_optimizers(optimizer) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return tuple(optimizer)
    raise TypeError(
        "graphed_step: optimizer must be a torch.optim.Optimizer, a list / tuple of them or None, "
        f"got {type(optimizer).__name__}"
    )


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``capturable`` on where the optimizer has it, with its state on the
    parameters' device (where a capturable step keeps all of it): the step counters and
    every other scalar a non-capturable step keeps on the host (NAdam's ``mu_product``)."""
    if "capturable" in optimizer.defaults:
        optimizer.defaults["capturable"] = True
    for group in optimizer.param_groups:
        if "capturable" not in group or group["capturable"]:
            continue
        group["capturable"] = True
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in list(state.items()):
                if isinstance(value, Tensor) and value.device != param.device:
                    state[key] = value.to(param.device)
            step = state.get("step")
            if step is not None and not isinstance(step, Tensor):
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device)


#: Optimizers whose groups :func:`_use_fused_implementation` may switch: torch's own Adam
#: and AdamW (exact types: a subclass may step without reading ``fused``), whose fused
#: CUDA kernel supports ``capturable`` and CUDA graphs.
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def _use_fused_implementation(optimizer: torch.optim.Optimizer, device_types: tuple[str, ...] = ("cuda",)) -> bool:
    """Switch the groups of a torch Adam / AdamW that chose no implementation (``foreach``
    and ``fused`` both ``None``, not ``differentiable``), whose ``betas`` are numbers and
    whose parameters are all floating point on ``device_types`` to torch's fused kernel
    (``fused=True``); their step counters become float32 tensors (what the fused kernel
    reads). Other optimizers and groups are left as built: tensor ``betas`` in
    particular, which the fused kernel takes as host numbers (a read-back in every step).
    (torch 2.11's multi-tensor update reads them back too, so such a group does not
    capture either way.) Returns whether any group was switched."""
    if type(optimizer) not in _FUSABLE:
        return False
    switched = False
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            continue
        if any(isinstance(beta, Tensor) for beta in group.get("betas", ())):
            continue
        params = group["params"]
        if not params or not all(p.is_floating_point() and p.device.type in device_types for p in params):
            continue
        group["fused"] = True
        for param in params:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, Tensor) and step.dtype != torch.float32:
                optimizer.state[param]["step"] = step.to(torch.float32)
        switched = True
    return switched


def _check_optimizer_state(optimizer: torch.optim.Optimizer, fn_name: str) -> None:
    """Refuse an optimizer that keeps state on the host for device parameters (e.g.
    Adagrad's step counter): a replay would use the value of the capture forever."""
    for param, state in optimizer.state.items():
        if not isinstance(param, Tensor) or param.device.type != "cuda":
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and value.device.type == "cpu":
                raise CaptureError(
                    f"graphed_step({fn_name}): {type(optimizer).__name__} keeps its state {key!r} on the "
                    "host for a CUDA parameter; a replayed step could never update it. Use an optimizer "
                    "with a capturable mode (Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, ...) or without "
                    "host state (SGD)",
                    reason=f"optimizer state {key!r} on the host",
                )


# ---------------------------------------------------------------------- diagnosis
_HINTS = (
    ("torch/optim/", "the optimizer reads a host value in step(): use one with a capturable mode "
     "(Adam, AdamW, RMSprop, ...; graphed_step switches it on) or without host state (SGD)"),
    ("fusegnn/sparse/processing.py", "graph processing inside the step reads sizes back to the host "
     "(a layer with cached=False, or processing called in the step): process the graph once outside "
     "the step, or use cached=True"),
    ("fusegnn/sparse/graph.py", "a fusegnn Graph is built or converted inside the step: build the Graph once "
     "outside and pass that same object (its caches are filled by the warm-up calls)"),
    ("fusegnn/kernels/", "a per-graph work list is built during the capture: the warm-up calls must use the "
     "same Graph object as the captured call"),
    ("torch_geometric/", "a PyG layer processes the graph on every call (GATConv removes and re-adds "
     "self-loops with boolean masks): precompute the processed edge_index (e.g. add_self_loops=False on "
     "a graph with self-loops) or use cached layers"),
)

_GENERIC = (
    "A CUDA graph records GPU work only; it cannot record a step that reads a device value back to "
    "the host: .item(), int() / float() / bool() of a CUDA tensor, print(tensor), boolean-mask "
    "indexing such as out[mask] (index with mask.nonzero() computed once outside), torch.nonzero / "
    "unique / masked_select, or building a Graph inside the step."
)


def _diagnose(err: BaseException, fn_name: str) -> CaptureError:
    """The :class:`CaptureError` of a failed capture: the root error, where it happened,
    what to do."""
    chain = [err]
    while True:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    root = chain[-1]  # the first error raised; later ones come from ending the capture
    reason = f"{type(root).__name__}: {_first_line(root)}"
    synced = "synchronizing" in str(root)
    frames = [f for f in traceback.extract_tb(root.__traceback__) if not _is_own_frame(f.filename)]
    user = None
    hint = ""
    if frames:
        user = next((f for f in reversed(frames) if not _in_torch(f.filename)), frames[-1])
        paths = [f.filename.replace("\\", "/") for f in frames]
        for marker, text in _HINTS:
            if any(marker in path for path in paths):
                hint = " Likely cause: " + text + "."
                break
    what = "the step synchronises with the host while being captured" if synced else "capturing the step failed"
    error = CaptureError(
        "", filename=user.filename if user else None, lineno=user.lineno if user else None,
        function=user.name if user else None, reason=reason, synchronised=synced,
    )
    where = ""
    if user is not None:
        code = (user.line or linecache.getline(user.filename, user.lineno)).strip()
        where = f" at {error.location}" + (f": `{code}`" if code else "")
    message = f"graphed_step({fn_name}): {what}{where} ({reason}).{hint} {_GENERIC}"
    if len(chain) > 1:
        message += f" (Then, ending the capture: {type(chain[0]).__name__}: {_first_line(chain[0])})"
    error.args = (message,)
    return error


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


_THIS_FILE = str(Path(__file__).resolve())


def _is_own_frame(filename: str) -> bool:
    try:
        return str(Path(filename).resolve()) == _THIS_FILE
    except OSError:
        return False


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _in_torch(filename: str) -> bool:
    try:
        return str(Path(filename).resolve()).startswith(_TORCH_DIR)
    except OSError:
        return False


def _shorten(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[-3:]) if len(parts) > 3 else filename
