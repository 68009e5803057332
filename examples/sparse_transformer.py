"""Train a small transformer encoder on a long-sequence retrieval task, dense against sparse.

    python examples/sparse_transformer.py                      # L = 4096 on a GPU, both models
    python examples/sparse_transformer.py --mask bigbird --seq-len 8192
    python examples/sparse_transformer.py --quick              # tiny CPU configuration (seconds)
    python examples/sparse_transformer.py --nm 2:4 --json-out nm.json   # N:M sparse attention (DFSS)
    python examples/sparse_transformer.py --ff-sparsity 0.9 --ff-vector 8 --finetune-steps 200  # pruned FF

**Task** (key-value retrieval; generated on the fly, a fresh batch every step, the same
batches for both models). A sequence of ``L`` tokens is mostly one filler token; at
``--pairs`` random positions sits a *record* token that encodes a (key, value) pair with
distinct keys; position 0 holds a *query* token naming one of the keys. The label is the
value of the record whose key is the query's (``--values`` classes; chance is
``1 / values``). Retrieval across the whole sequence is what the global token does: in a
Longformer / BigBird mask, position 0 attends to every position and every position to
it; the local window lets neighbouring positions exchange information, as in the dense
model. Both models see sinusoidal positions.

**Models.** The same network, built from the same seed (identical initial weights):
factorised token embedding (type + key + value vectors) + sinusoidal positions -> ``--layers`` pre-norm
:class:`~fusegnn.layers.SparseTransformerEncoderLayer` -> LayerNorm -> linear classifier
on position 0. The ``dense`` model gives its layers no mask (PyTorch's fused SDPA, full
attention); the ``sparse`` model gives them a fusegnn mask (Longformer: window +
``--num-global`` global tokens, or BigBird: plus random blocks), run by
:func:`fusegnn.attention.sparse_attention.sparse_attention` with ``--aggregation`` (default
``auto``: on a GPU the fused block-sparse Triton kernel, or PyTorch's dense SDPA with the
boolean mask where the op's calibrated cost model predicts it faster -- short sequences;
the dense reference on the CPU). The summary's ``sparse_path`` / ``sparse_path_label``
say which path the sparse model's training step takes, ``sparse_path_reason`` why. On
CUDA both run under bf16 autocast.

``--nm N:M`` (``1:2``, ``2:4``, ``4:8``) makes every model's attention dynamically N:M
sparse (DFSS, :mod:`fusegnn.kernels.nm_sparsity`): of every ``M`` consecutive keys of a
query only the ``N`` largest scores enter the softmax -- for the ``dense`` model over all
keys, for the ``sparse`` one over its mask's. It runs the fused block kernel on a GPU
(``nm`` forces the block path; dense SDPA cannot drop scores), the reference on the
CPU. Compare a run with ``--nm 2:4`` against one without (same seed, same batches).

**Vector-sparse feed-forward fine-tuning** (``--ff-sparsity S --ff-vector V
--finetune-steps K``, issue #17). After the ``--steps`` training steps, each model gets a
pruned copy: every layer's ``linear1`` / ``linear2`` magnitude-pruned to sparsity ``S`` in
``V``-vectors (:meth:`~fusegnn.layers.SparseTransformerEncoderLayer.sparsify_feedforward`,
:meth:`~fusegnn.layers.VectorSparseLinear.from_linear`: the trained values of the kept
vectors, the pattern fixed from then on), with the model's AdamW state carried over (the
moments at the kept vectors). The copy is fine-tuned ``K`` steps while the unpruned model
continues ``K`` steps too, both on the same batches (the training stream, continued), so
that they differ by the pruning only. Reported per model (``finetune`` in the JSON, a
middle panel in the plot): the held-out loss / accuracy right after pruning, the
fine-tuned and continued runs (loss curves, step times, held-out evaluation), and the
**relative loss gap** ``(pruned - continued) / continued`` of the *held-out* loss after the
``K`` steps -- the one held to the issue's 2 % target, being the final state on unseen data
without optimizer noise; beside it the gap of the mean training loss over the last
``--compare-window`` (50) steps. ``--ff-sparsity 0`` prunes nothing and reproduces the
continued run (a check of the carried state). On the CPU the pruned FF runs vspmm's
reference; on CUDA the Triton kernels, in float32 (``VectorSparseLinear`` keeps its
values' dtype; autocast does not cast them).

Per step it logs the training loss of both models and their step times (CUDA-event /
``perf_counter``, the first ``--warmup`` steps excluded from the mean); at the end it
evaluates both on held-out batches. ``--json`` prints a JSON summary (curves included)
as the last line, ``--json-out PATH`` writes it to a file; ``--plot PATH`` draws the loss
curves and step times (matplotlib).

**Measured** (NVIDIA H200, torch 2.11, Triton 3.6; defaults otherwise; results in
``benchmarks/results/examples/``):

* ``--seq-len 4096 --steps 3000``: both models learn the task -- training loss first below
  0.1 at step 412 (dense) and 555 (sparse), held-out accuracy 1.0 for both, same curve
  shape (a plateau at chance, then a drop within about 100 steps). Step time 7.84 ms
  dense, 7.17 ms sparse (1.09x: at this model size the attention is a small part of the
  step). The sparse model's path is the block kernel at 64 x 64.
* ``--seq-len 16384 --steps 1500``: 44.8 ms dense, 17.0 ms sparse per step (2.63x);
  neither model has left the plateau after 1500 steps (held-out accuracy 0.21, chance
  0.125) -- the longer sequence needs a longer run.
* A CPU run with ``--seq-len 1024 --steps 500 --models dense``: training loss below 0.2
  after about 175 steps, held-out accuracy 1.0.
* N:M against dense (CPU, reference path, ``--seq-len 512 --steps 400 --models dense
  --eval-batches 64``, with and without ``--nm 2:4``): held-out accuracy 1.000 with 2:4
  and 0.985 without (seed 0), 1.000 and 1.000 (seed 1); training loss first below 0.1 at
  step 151 / 108 (2:4) and 185 / 116 (dense)
  (``benchmarks/results/examples/sparse-transformer-nm-L512-cpu.json``).
* Vector-sparse FF fine-tuning (CPU, ``--seq-len 512 --steps 400 --models dense
  --eval-batches 64 --ff-sparsity 0.9 --ff-vector 8 --finetune-steps 200``, seed 0, one run):
  FF density 0.100. Held-out loss 0.0697 (accuracy 0.985) at step 400; right after pruning
  0.1002 (0.984); after 200 fine-tuning steps 0.0039 (1.000) against 0.0070 (1.000) for the
  unpruned model continued 200 steps -- a relative gap of -44 % (the pruned model lower,
  inside the 2 % target); mean training loss over the last 50 steps 0.0044 against 0.0217
  (-80 %: the unpruned model's training loss keeps spiking on single batches at lr 1e-3, the
  pruned one's not). Step time 1179 ms pruned against 277 ms on two shared cores (vspmm's
  pure-PyTorch reference, no speed claim). Seed 1: held-out loss 0.0026 (1.000) pruned
  against 0.0019 (1.000) continued, +42 % -- outside the 2 % target. At held-out losses of
  0.002-0.007 the relative gap is noise of either sign (-44 % / +42 %); both seeds keep
  accuracy 1.000, and the absolute gaps are below 0.004 nats
  (``benchmarks/results/examples/sparse-transformer-ff90-v8-L512-cpu.json``, ``seed1``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_cli.py, imported below
try:
    import fusegnn  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import check_device, check_range, show_progress  # noqa: E402

from fusegnn.losses import linear_cross_entropy
from fusegnn.layers import SparseTransformerEncoderLayer, VectorSparseLinear
from fusegnn.sparse import VectorSparse
from fusegnn.attention.masks import Mask, bigbird, longformer
from fusegnn.attention.sparse_attention import ATTENTION_AGGREGATIONS, AttentionDecision, check_nm, explain_attention

FILLER, QUERY0 = 0, 1  # token ids: filler, then query tokens (one per key), then records

#: ``--quick``'s tiny CPU configuration: the defaults of the flags not given with it
QUICK = dict(seq_len=128, keys=8, values=4, pairs=4, window=8, num_global=16, d_model=32, heads=2, ff=64,
             batch=4, eval_batches=2, steps=30, finetune_steps=10, warmup=2, log_every=10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length L (>= 2048 for the real task)")
    p.add_argument("--keys", type=int, default=16, help="distinct keys")
    p.add_argument("--values", type=int, default=8, help="distinct values (the classes)")
    p.add_argument("--pairs", type=int, default=8, help="records per sequence")
    p.add_argument("--mask", choices=("longformer", "bigbird"), default="longformer")
    p.add_argument("--window", type=int, default=128, help="local window (|q - k| <= window)")
    p.add_argument("--num-global", type=int, default=64, help="global tokens (position 0 is the query)")
    p.add_argument("--random-density", type=float, default=0.03, help="bigbird: fraction of random 64x64 blocks")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=256, help="feed-forward width")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5, help="first steps not counted in the step time")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--aggregation", default="auto", choices=ATTENTION_AGGREGATIONS,
                   help="path of the sparse model's attention (see fusegnn.attention.sparse_attention)")
    p.add_argument("--models", default="dense,sparse", help="comma-separated subset of dense,sparse")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--quick", action="store_true",
                   help="tiny configuration for a CPU smoke run (the defaults of the flags not given)")
    p.add_argument("--nm", default=None, help="N:M sparse attention for every model, e.g. 2:4 (1:2, 2:4 or 4:8)")
    p.add_argument("--ff-sparsity", type=float, default=None,
                   help="after training, prune every layer's feed-forward weights to this sparsity (V-vectors, "
                        "magnitude) and fine-tune (module doc); default: no fine-tuning phase")
    p.add_argument("--ff-vector", type=int, default=8, help="vector length V of the pruned feed-forward (2, 4, 8, 16)")
    p.add_argument("--finetune-steps", type=int, default=200,
                   help="fine-tuning steps after pruning (the unpruned model continues as many)")
    p.add_argument("--compare-window", type=int, default=50,
                   help="last fine-tuning steps whose mean training loss is compared")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--json-out", type=Path, help="write the JSON summary (loss curves included) to this file")
    p.add_argument("--plot", type=Path, help="write the loss curves and step times to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-step logs")
    quick, _ = p.parse_known_args(argv)  # --quick changes the defaults, never a flag given
    if quick.quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    for flag in ("--steps", "--eval-batches", "--log-every", "--batch", "--layers", "--pairs", "--keys",
                 "--heads", "--d-model", "--ff"):
        check_range(p, flag, getattr(args, flag[2:].replace("-", "_")), low=1)
    check_range(p, "--values", args.values, low=2)
    for flag in ("--warmup", "--window", "--num-global"):
        check_range(p, flag, getattr(args, flag[2:].replace("-", "_")), low=0)
    check_range(p, "--lr", args.lr, low=0, low_open=True)
    check_range(p, "--random-density", args.random_density, low=0, high=1)
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install -e '.[bench]')")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(p, args.device)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in ("dense", "sparse")]
    if bad or not args.models:
        p.error(f"--models takes dense and/or sparse, got {bad or 'nothing'}")
    if args.pairs > args.keys:
        p.error("--pairs must be <= --keys (records have distinct keys)")
    if args.pairs + 1 > args.seq_len:
        p.error("--seq-len too short for --pairs records")
    try:
        args.nm = check_nm(args.nm)
    except (TypeError, ValueError) as err:
        p.error(f"--nm: {err}")
    if args.ff_sparsity is not None:
        if not 0.0 <= args.ff_sparsity < 1.0:
            p.error(f"--ff-sparsity must be in [0, 1), got {args.ff_sparsity}")
        if args.ff_vector not in VectorSparse.VECTOR_SIZES:
            p.error(f"--ff-vector must be one of {VectorSparse.VECTOR_SIZES}, got {args.ff_vector}")
        if args.finetune_steps < 1 or args.compare_window < 1:
            p.error("--finetune-steps and --compare-window must be >= 1")
        args.compare_window = min(args.compare_window, args.finetune_steps)
    return args


# ----------------------------------------------------------------------------- data
def make_batch(args: argparse.Namespace, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    """``tokens [B, L]`` and ``labels [B]`` of the retrieval task (see the module doc)."""
    B, L, P = args.batch, args.seq_len, args.pairs
    tokens = torch.full((B, L), FILLER, dtype=torch.long)
    keys = torch.rand(B, args.keys, generator=gen).argsort(dim=1)[:, :P]  # distinct keys
    values = torch.randint(0, args.values, (B, P), generator=gen)
    positions = torch.rand(B, L - 1, generator=gen).argsort(dim=1)[:, :P] + 1  # never 0
    record = QUERY0 + args.keys + keys * args.values + values
    tokens.scatter_(1, positions, record)
    pick = torch.randint(0, P, (B,), generator=gen)
    rows = torch.arange(B)
    tokens[:, 0] = QUERY0 + keys[rows, pick]
    labels = values[rows, pick]
    return tokens.to(device), labels.to(device)


def build_mask(args: argparse.Namespace) -> Mask:
    L = args.seq_len
    if args.mask == "longformer":
        return longformer(L, args.window, args.num_global)
    return bigbird(L, args.window, args.num_global, 64, args.random_density, seed=args.seed)


# ----------------------------------------------------------------------------- model
def sinusoidal_positions(L: int, d: int) -> Tensor:
    pos = torch.arange(L, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(L, d)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return pe


class RetrievalEmbedding(nn.Module):
    """Factorised token embedding: ``type + key + value`` vectors (filler / query / record),
    so a key looks the same in the query and in its record and the model learns 64 key
    and 16 value vectors rather than one vector per (key, value) record."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.keys, self.values = args.keys, args.values
        self.kind = nn.Embedding(3, args.d_model)
        self.key = nn.Embedding(args.keys, args.d_model)
        self.value = nn.Embedding(args.values, args.d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        is_query = (tokens >= QUERY0) & (tokens < QUERY0 + self.keys)
        is_record = tokens >= QUERY0 + self.keys
        rec = (tokens - QUERY0 - self.keys).clamp(min=0)
        key = torch.where(is_query, tokens - QUERY0, rec // self.values).clamp(min=0)
        kind = is_query.long() + 2 * is_record.long()
        x = self.kind(kind) + self.key(key) * (is_query | is_record).unsqueeze(-1)
        return x + self.value(rec % self.values) * is_record.unsqueeze(-1)


class RetrievalEncoder(nn.Module):
    """Embedding + sinusoidal positions -> pre-norm encoder layers -> classifier on token 0."""

    def __init__(self, args: argparse.Namespace, mask: Mask | None) -> None:
        super().__init__()
        self.embed = RetrievalEmbedding(args)
        self.register_buffer("positions", sinusoidal_positions(args.seq_len, args.d_model), persistent=False)
        self.layers = nn.ModuleList(
            SparseTransformerEncoderLayer(
                args.d_model, args.heads, args.ff, dropout=0.0, activation="gelu", norm_first=True,
                mask=mask, aggregation=args.aggregation, nm=args.nm,
            )
            for _ in range(args.layers)
        )
        self.norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.values)

    def features(self, tokens: Tensor) -> Tensor:
        """The classifier's input: the normalised state of token 0."""
        x = self.embed(tokens) + self.positions[: tokens.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x[:, 0])

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.features(tokens))

    def loss(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """Cross-entropy of the head's logits, fused with the head
        (:func:`fusegnn.losses.linear_cross_entropy`: the logits are never written)."""
        h = self.features(tokens)
        weight, bias = self.head.weight, self.head.bias
        if h.dtype != weight.dtype:  # autocast: the loss runs in the features' precision
            weight, bias = weight.to(h.dtype), bias.to(h.dtype)
        return linear_cross_entropy(h, weight, labels, bias).float()


# ----------------------------------------------------------------------------- training
class StepTimer:
    """Wall time of one step: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "StepTimer":
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def sparse_path(args: argparse.Namespace, mask: Mask, device: torch.device) -> AttentionDecision:
    """The path a training step of the sparse model runs: its ``q`` shape and dtype (bf16
    under autocast on CUDA), with a backward."""
    probe = torch.empty(1, args.heads, args.seq_len, args.d_model // args.heads, device=device,
                        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    probe = probe.expand(args.batch, -1, -1, -1)
    return explain_attention(probe, mask, aggregation=args.aggregation, backward=True, nm=args.nm)


def path_lines(args: argparse.Namespace, decision: AttentionDecision | None, device: torch.device) -> list[str]:
    """What runs, said once before training: the sparse model's attention path and why,
    and on the CPU that the fused kernels need CUDA."""
    dense = "PyTorch's SDPA (full attention)" if args.nm is None else f"full attention, N:M {args.nm[0]}:{args.nm[1]}"
    lines = [f"dense model: {dense}"] if "dense" in args.models else []
    if decision is not None:
        lines.append(f"sparse model: {decision.label} -- {decision.reason}")
    if device.type == "cpu":
        lines.append(
            "on the CPU the fused block-sparse kernels do not run (they need CUDA, or Triton's "
            "interpreter TRITON_INTERPRET=1, slow, for testing): auto takes the pure-PyTorch reference"
        )
    return lines


def evaluate(model: nn.Module, args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(args.seed + 10_000)  # held-out stream, same for both
    model.eval()
    losses, correct, total = [], 0, 0
    with torch.no_grad(), _autocast(device):
        for _ in range(args.eval_batches):
            tokens, labels = make_batch(args, gen, device)
            logits = model(tokens).float()
            losses.append(F.cross_entropy(logits, labels).item())
            correct += int((logits.argmax(-1) == labels).sum())
            total += labels.numel()
    model.train()
    return {"loss": statistics.fmean(losses), "accuracy": correct / total}


def run_steps(
    models: dict[str, nn.Module], optims: dict[str, torch.optim.Optimizer], args: argparse.Namespace,
    gen: torch.Generator, device: torch.device, steps: int, first: int = 0, desc: str = "train",
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``steps`` optimizer steps of every model, each step on one fresh batch of ``gen``'s
    stream that all models share; the per-step training losses and step times (ms).
    ``first`` numbers the logged steps (a phase that continues another)."""
    curves = {name: [] for name in models}
    times = {name: [] for name in models}
    bar = tqdm(range(steps), desc=desc, disable=not show_progress(args.quiet), dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        tokens, labels = make_batch(args, gen, device)
        for name, model in models.items():
            opt = optims[name]
            with StepTimer(device) as timer:
                opt.zero_grad(set_to_none=True)
                with _autocast(device):
                    loss = model.loss(tokens, labels)
                loss.backward()
                opt.step()
            curves[name].append(loss.item())
            times[name].append(timer.ms)
        bar.set_postfix({n: f"{c[-1]:.3f}" for n, c in curves.items()})
        if not args.quiet and (first + step + 1) % args.log_every == 0:
            parts = [f"{n} loss {c[-1]:.4f} ({times[n][-1]:.1f} ms)" for n, c in curves.items()]
            tqdm.write(f"step {first + step + 1}: " + ", ".join(parts), file=sys.stderr)
    bar.close()
    return curves, times


def run_summary(curve: list[float], times: list[float], args: argparse.Namespace, eval_result: dict) -> dict:
    """One model's results over one phase: losses, step times, held-out evaluation."""
    counted = times[args.warmup:] or times
    return {
        "final_train_loss": statistics.fmean(curve[-10:]),
        "step_ms_mean": statistics.fmean(counted),
        "step_ms_median": statistics.median(counted),
        "eval": eval_result,
        "loss_curve": curve,
        "step_ms": times,
    }


def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    mask = build_mask(args) if "sparse" in args.models else None
    models, optims = {}, {}
    for name in args.models:
        torch.manual_seed(args.seed)  # identical initial weights
        models[name] = RetrievalEncoder(args, mask if name == "sparse" else None).to(device)
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=args.lr)
    decision = sparse_path(args, mask, device) if mask is not None else None
    if not args.quiet:
        for line in path_lines(args, decision, device):
            print(line, file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    curves, times = run_steps(models, optims, args, gen, device, args.steps)

    summary: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "chance_loss": math.log(args.values),
        "nm": f"{args.nm[0]}:{args.nm[1]}" if args.nm is not None else None,
        "models": {},
    }
    if decision is not None:
        summary["sparse_path"] = decision.name
        summary["sparse_path_label"] = decision.label
        summary["sparse_path_reason"] = decision.reason
        summary["mask"] = repr(mask)
    for name, model in models.items():
        summary["models"][name] = run_summary(curves[name], times[name], args, evaluate(model, args, device))
    if {"dense", "sparse"} <= set(models):
        summary["speedup_sparse_over_dense"] = (
            summary["models"]["dense"]["step_ms_median"] / summary["models"]["sparse"]["step_ms_median"]
        )
    if args.ff_sparsity is not None:
        summary["finetune"] = finetune(args, models, optims, gen, device)
    return summary


# ----------------------------------------------------------------------------- pruning + fine-tuning
#: the issue's target: the pruned model's loss within this fraction of the unpruned one's
TARGET_REL_GAP = 0.02


def prune_feedforward(model: RetrievalEncoder, sparsity: float, V: int) -> RetrievalEncoder:
    """A copy of the trained ``model`` whose layers' feed-forward linears are vector-sparse
    (:meth:`~fusegnn.layers.SparseTransformerEncoderLayer.sparsify_feedforward`: each
    weight magnitude-pruned to ``sparsity`` in ``V``-vectors, the trained values kept);
    ``model`` is unchanged, the attention masks are shared rather than copied."""
    memo = {id(layer.mask): layer.mask for layer in model.layers if layer.mask is not None}
    pruned = copy.deepcopy(model, memo)
    for layer in pruned.layers:
        layer.sparsify_feedforward(sparsity, V)
    return pruned


def ff_density(model: RetrievalEncoder) -> float:
    """Kept weights of the vector-sparse feed-forward linears over their dense size."""
    linears = [m for m in model.modules() if isinstance(m, VectorSparseLinear)]
    if not linears:
        raise ValueError("the model has no VectorSparseLinear feed-forward to measure")
    return sum(m.values.numel() for m in linears) / sum(m.in_features * m.out_features for m in linears)


def _at_pattern(dense: Tensor, pattern: VectorSparse) -> Tensor:
    """``dense`` (``[M, K]``) sampled at ``pattern``'s vectors, as its ``[nnz_v, V]`` values."""
    (M, K), V = pattern.shape, pattern.V
    padded = torch.cat([dense, dense.new_zeros(pattern.num_groups * V - M, K)]).view(-1, V, K)
    return padded[pattern.vector_groups(), :, pattern.col_idx.long()].clone()


def carry_optimizer_state(src: torch.optim.Optimizer, src_model: nn.Module,
                          dst: torch.optim.Optimizer, dst_model: nn.Module) -> None:
    """Give ``dst`` (over the pruned copy ``dst_model``) the AdamW state ``src`` holds for
    ``src_model``: parameters of the same name get a copy, a pruned weight's kept vectors
    the moments at their pattern -- so fine-tuning continues the optimizer as the unpruned
    model does, and the two runs differ by the pruning only."""
    src_params = dict(src_model.named_parameters())
    modules = dict(dst_model.named_modules())
    for name, param in dst_model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        module = modules[prefix]
        pruned = isinstance(module, VectorSparseLinear) and leaf == "values"
        state = src.state.get(src_params[f"{prefix}.weight" if pruned else name])
        if not state:
            continue
        dst.state[param] = {
            key: _at_pattern(value, module.pattern()) if pruned and key != "step" else value.clone()
            for key, value in state.items()
        }


def _relative_gap(pruned: float, dense: float) -> float:
    return (pruned - dense) / dense if dense > 0 else math.inf * (pruned > 0)


def finetune(args: argparse.Namespace, models: dict[str, RetrievalEncoder],
             optims: dict[str, torch.optim.Optimizer], gen: torch.Generator, device: torch.device) -> dict:
    """Prune each trained model's feed-forward to ``--ff-sparsity`` (``--ff-vector``-vectors)
    and fine-tune it ``--finetune-steps`` steps, while the unpruned model continues as
    many steps on the same batches (``gen``'s stream, where training left it).

    The loss compared is the **held-out loss** (the mean cross-entropy over the
    ``--eval-batches`` held-out batches, the same for every model) at the end of the
    fine-tuning: the state the fine-tuning ends in, on data neither model trained on, with
    no optimizer noise. Its relative gap ``(pruned - continued) / continued`` is the one
    held to the 2 % target. The mean training loss over the last ``--compare-window``
    steps (identical batches for both) is reported beside it."""
    runs: dict[str, RetrievalEncoder] = {}
    run_optims: dict[str, torch.optim.Optimizer] = {}
    pruned_names, results = {}, {}
    for name, model in models.items():
        pruned = prune_feedforward(model, args.ff_sparsity, args.ff_vector)
        opt = torch.optim.AdamW(pruned.parameters(), lr=args.lr)
        carry_optimizer_state(optims[name], model, opt, pruned)
        pruned_names[name] = f"{name}+ff{args.ff_vector}"
        runs[name], run_optims[name] = model, optims[name]
        runs[pruned_names[name]], run_optims[pruned_names[name]] = pruned, opt
        results[name] = {"ff_density": ff_density(pruned), "pruned_eval": evaluate(pruned, args, device)}
    curves, times = run_steps(runs, run_optims, args, gen, device, args.finetune_steps, first=args.steps,
                              desc="fine-tune")
    window = args.compare_window
    for name in models:
        pname = pruned_names[name]
        cont = run_summary(curves[name], times[name], args, evaluate(runs[name], args, device))
        tuned = run_summary(curves[pname], times[pname], args, evaluate(runs[pname], args, device))
        for res, curve in ((cont, curves[name]), (tuned, curves[pname])):
            res["window_train_loss"] = statistics.fmean(curve[-window:])
        tuned["first_train_loss"] = curves[pname][0]  # the pruned model's loss on its first new batch
        gap = _relative_gap(tuned["eval"]["loss"], cont["eval"]["loss"])
        results[name].update(
            pruned_name=pname,
            continued=cont,
            finetuned=tuned,
            loss_gap_rel=gap,
            loss_gap_abs=tuned["eval"]["loss"] - cont["eval"]["loss"],
            window_loss_gap_rel=_relative_gap(tuned["window_train_loss"], cont["window_train_loss"]),
            accuracy_diff=tuned["eval"]["accuracy"] - cont["eval"]["accuracy"],
            within_target=gap <= TARGET_REL_GAP,
        )
    return {
        "ff_sparsity": args.ff_sparsity,
        "ff_vector": args.ff_vector,
        "steps": args.finetune_steps,
        "compare_window": window,
        "target_rel_gap": TARGET_REL_GAP,
        "loss_compared": (f"held-out loss ({args.eval_batches} batches) after fine-tuning, relative to the unpruned "
                          f"model continued as many steps; the mean training loss over the last {window} steps "
                          "beside it (window_loss_gap_rel)"),
        "models": results,
    }


# ----------------------------------------------------------------------------- output
def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ft = summary.get("finetune")
    fig, axes = plt.subplots(1, 3 if ft else 2, figsize=(16 if ft else 11, 4))
    ax1, ax_t = axes[0], axes[-1]
    steps = summary["config"]["steps"]
    for name, res in summary["models"].items():
        (line,) = ax1.plot(res["loss_curve"], label=name)
        ax_t.plot(res["step_ms"], label=f"{name} (median {res['step_ms_median']:.1f} ms)", color=line.get_color())
        if not ft:
            continue
        r = ft["models"][name]
        after = range(steps, steps + ft["steps"])
        for key, style, label in (("continued", "-", f"{name}, continued"),
                                  ("finetuned", "--", f"{r['pruned_name']} (pruned, fine-tuned)")):
            curve, ms = r[key]["loss_curve"], r[key]["step_ms"]
            ax1.plot(after, curve, style, color=line.get_color(), lw=0.8)
            axes[1].plot(after, curve, style, color=line.get_color(), lw=0.5, alpha=0.35)
            k = max(1, min(10, len(curve)))  # running mean over k steps
            smooth = [statistics.fmean(curve[max(0, i - k + 1): i + 1]) for i in range(len(curve))]
            axes[1].plot(after, smooth, style, color=line.get_color(),
                         label=f"{label}: held-out {r[key]['eval']['loss']:.4f} / acc {r[key]['eval']['accuracy']:.3f}")
            ax_t.plot(after, ms, style, color=line.get_color(),
                      label=f"{label} (median {r[key]['step_ms_median']:.1f} ms)")
    ax1.axhline(summary["chance_loss"], color="gray", ls="--", lw=0.8, label="chance")
    ax1.set(xlabel="step", ylabel="train loss", title=f"retrieval, L = {summary['config']['seq_len']}")
    if ft:
        ax1.axvline(steps, color="k", lw=0.6, ls=":")
        gaps = ", ".join(f"{n}: {100 * r['loss_gap_rel']:+.1f} %" for n, r in ft["models"].items())
        axes[1].set(xlabel="step", ylabel="train loss (10-step running mean)", yscale="log",
                    title=f"FF pruned to {ft['ff_sparsity']:g} (V = {ft['ff_vector']}); held-out loss gap {gaps}")
        axes[1].legend(fontsize=7)
    ax_t.set(xlabel="step", ylabel="step time (ms)", yscale="log", title=summary["device"])
    ax1.legend(fontsize=7 if ft else None)
    ax_t.legend(fontsize=7 if ft else None)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = train(args)
    for name, res in summary["models"].items():
        print(
            f"{name:6s} final train loss {res['final_train_loss']:.4f}, eval loss {res['eval']['loss']:.4f}, "
            f"eval acc {res['eval']['accuracy']:.3f}, step {res['step_ms_median']:.2f} ms (median)"
        )
    if "speedup_sparse_over_dense" in summary:
        print(f"sparse ({summary.get('sparse_path_label')}) is {summary['speedup_sparse_over_dense']:.2f}x the speed of dense")
    for name, r in summary.get("finetune", {}).get("models", {}).items():
        cont, tuned = r["continued"], r["finetuned"]
        print(
            f"{r['pruned_name']}: FF density {r['ff_density']:.3f}; held-out loss right after pruning "
            f"{r['pruned_eval']['loss']:.4f} (acc {r['pruned_eval']['accuracy']:.3f}), after fine-tuning "
            f"{tuned['eval']['loss']:.4f} (acc {tuned['eval']['accuracy']:.3f}) against {cont['eval']['loss']:.4f} "
            f"(acc {cont['eval']['accuracy']:.3f}) for {name} continued: gap {100 * r['loss_gap_rel']:+.2f} % "
            f"({'within' if r['within_target'] else 'outside'} the 2 % target); last-"
            f"{summary['finetune']['compare_window']}-step training loss {tuned['window_train_loss']:.4f} "
            f"against {cont['window_train_loss']:.4f} ({100 * r['window_loss_gap_rel']:+.2f} %)"
        )
    if args.plot:
        plot(summary, args.plot)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
