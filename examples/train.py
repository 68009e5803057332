"""Train a GNN (GCN, GAT, GraphSAGE, GIN, GATv2, SGC, APPNP) for full-graph node classification.

    python examples/train.py                                   # GCN on Cora, 10 runs
    python examples/train.py --dataset CiteSeer --model gat
    python examples/train.py --model appnp                     # also sage, gin, gatv2, sgc
    python examples/train.py --dataset Reddit --root /data --device cuda --runs 1
    python examples/train.py --device cuda --no-cuda-graph     # eager training steps (no CUDA graph)
    python examples/train.py --dataset Reddit --model sage --sampled --num-neighbors 25,10 --batch-size 1024

The published recipes are the defaults (GCN: hidden 16, dropout 0.5, lr 0.01, weight decay
5e-4, 200 epochs; GAT: 8 heads x 8, dropout 0.6, lr 0.005, weight decay 5e-4, one output
head (8 on PubMed), early stopping on validation loss with patience 100; GATv2: GAT's;
SGC: K = 2, lr 0.2, 100 epochs (the SGC paper's), weight decay 5e-5 (the best validation
accuracy of 5e-6, 2e-5, 5e-5 and PyG example's 5e-3 on Cora; the paper tunes it); APPNP: an MLP of hidden
64, dropout 0.5, K = 10, alpha = 0.1, lr 0.01, weight decay 5e-4 (PyG's citation
benchmark); GraphSAGE (mean) and GIN, for which no citation-graph recipe is published:
hidden 64, dropout 0.5, lr 0.01, weight decay 5e-4, 200 epochs). Each run reports
the test accuracy of the epoch with the best validation accuracy (ties: lower validation
loss): the model is selected on validation only, never on test.

On CUDA the example trains with :func:`fusegnn.graphed_step` by default (``--no-cuda-graph``
turns it off; on the CPU the steps run eagerly): the first epochs run
eagerly (warm-up), the next captures the whole training step -- forward, loss, backward,
Adam step (``capturable=True``) -- into a CUDA graph, and every later epoch replays it with
one launch. On small graphs such as Cora a step is bound by kernel launches, so this is
where the time goes; the results are the same up to rounding and dropout draws (a new
mask at every replay). Evaluation stays eager. The loss is computed on index tensors of
the training nodes (``mask.nonzero()`` once, outside the step): boolean-mask indexing
reads a size back to the host, which a capture cannot record.

With ``--sampled`` each epoch trains on mini-batches instead of the full graph: batches
of ``--batch-size`` training nodes with their sampled neighbourhoods
(:class:`fusegnn.loader.NeighborLoader`, ``--num-neighbors`` incoming neighbours per hop,
uniformly without replacement, on the data's device). The model runs on each batch's
merged subgraph and the loss is taken on its seeds (PyG's convention: the first
``batch_size`` rows); graph caches are off (each batch is a new graph) and so is the CUDA
graph (each batch has its own shapes). Evaluation stays full-graph.

Before training it says which path each layer takes -- GAS or GAR (the fused Triton
kernels), the row windows (``--aggregation window``, GCN / SGC / APPNP only) or the
pure-PyTorch reference -- and why (the op layer's own reason,
:func:`fusegnn.sparse.dispatch.decisions_taken`). On the CPU that is the reference: the
fused kernels need CUDA, or Triton's interpreter (``TRITON_INTERPRET=1`` with
``--aggregation gas`` / ``gar``), which is slow and meant for testing.

``--reorder rcm|degree|metis`` renumbers the nodes in a locality order before training
(:meth:`fusegnn.datasets.NodeDataset.reorder`: neighbours get nearby ids, so the kernels'
row gathers hit the L2 cache more; the graph and the results are the same). It pays on
large graphs: 6-11 % a step on the Reddit-sized graph on an H100 (METIS; ``degree`` was
slower there), after a one-time ordering on the host (RCM 12 s, METIS 51 s there, so it pays
back after 13,000-18,000 GCN steps, some 50,000 GAT steps; ``metis`` needs ``pymetis``).

Data is looked for in ``--root``, then ``$FUSEGNN_DATA``, then ``~/.cache/fusegnn``, then
downloaded. A missing data set, a ``--root`` that does not exist or a path that cannot run
here is one message and exit status 2 (``--debug`` shows the traceback). The progress
bar (on stderr) is drawn only when stdout and stderr are both terminals, and never with
``--quiet``: a log, a pipe or CI gets none. With ``--json``
the last line printed is one JSON object with the summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_cli.py, imported below
try:
    import fusegnn  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import USER_ERRORS, check_device, check_device_present, check_range, fail, show_progress  # noqa: E402

from fusegnn.capture import graphed_step
from fusegnn.datasets import DATASETS, NodeDataset, cache_dir, load_dataset
from fusegnn.loader import NeighborLoader
from fusegnn.models import GAT, GCN, GIN, SGC, APPNPNet, GATv2, GraphSAGE
from fusegnn.sparse import SPMM_AGGREGATIONS
from fusegnn.sparse.reorder import REORDER_METHODS
from fusegnn.sparse.dispatch import Decision, decisions_taken, for_capture

RECIPES = {
    "gcn": dict(hidden=16, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None),
    "gat": dict(hidden=8, dropout=0.6, lr=0.005, weight_decay=5e-4, epochs=1000, patience=100),
    "gatv2": dict(hidden=8, dropout=0.6, lr=0.005, weight_decay=5e-4, epochs=1000, patience=100),
    "sage": dict(hidden=64, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None),
    "gin": dict(hidden=64, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None),
    "sgc": dict(hidden=None, dropout=0.0, lr=0.2, weight_decay=5e-5, epochs=100, patience=None),
    "appnp": dict(hidden=64, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None),
}


# the models whose layers aggregate by spmm alone (GCNConv, SGConv, APPNP): they take --aggregation window
WINDOW_MODELS = ("appnp", "gcn", "sgc")


def parse_args(argv: list[str] | None = None, *, hidden: tuple[str, ...] = (),
               description: str | None = None) -> argparse.Namespace:
    """The options, with the recipe's values for those not given. ``hidden`` flags are left
    out of ``--help`` and ``description`` replaces its first line (a script that parses
    with these options: ``train_distributed.py``)."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    p.add_argument("--dataset", default="Cora", help=f"one of {', '.join(DATASETS)}")
    p.add_argument("--model", choices=sorted(RECIPES), default="gcn")
    p.add_argument("--hidden", type=int, help="hidden width (per head for GAT / GATv2; SGC has none)")
    p.add_argument("--heads", type=int, default=8, help="GAT / GATv2 heads in the first layer")
    p.add_argument("--out-heads", type=int, help="GAT / GATv2 heads in the output layer (1; 8 on PubMed)")
    p.add_argument("--K", type=int, help="SGC / APPNP propagation steps (SGC: 2, APPNP: 10)")
    p.add_argument("--alpha", type=float, default=0.1, help="APPNP teleport probability")
    p.add_argument("--aggr", choices=("mean", "max", "sum"), default="mean", help="GraphSAGE aggregation")
    p.add_argument("--epochs", type=int)
    p.add_argument("--patience", type=int, help="early-stopping patience on validation loss (GAT: 100)")
    p.add_argument("--lr", type=float)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--dropout", type=float)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", help=f"data root, <root>/<Name>/raw (else $FUSEGNN_DATA, else the cache {cache_dir()}, "
                                  "else a download into the cache)")
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--aggregation", choices=SPMM_AGGREGATIONS, default="auto",
                   help="sparse-op path; 'window' (row windows, spmm only) for the models "
                        f"{', '.join(WINDOW_MODELS)}")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the training step into a CUDA graph and replay it every epoch "
                        "(default: on CUDA devices; --no-cuda-graph for eager steps)")
    p.add_argument("--sampled", action="store_true",
                   help="train on neighbour-sampled mini-batches (fusegnn.loader.NeighborLoader)")
    p.add_argument("--num-neighbors", default="25,10",
                   help="with --sampled: neighbours drawn per hop, comma-separated (-1: all)")
    p.add_argument("--batch-size", type=int, default=1024, help="with --sampled: seed nodes per batch")
    p.add_argument("--no-normalize-features", action="store_true", help="keep raw Planetoid features")
    p.add_argument("--reorder", choices=("none",) + REORDER_METHODS, default="none",
                   help="renumber the nodes in a locality order first (faster steps on large graphs)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or path lines (the bar is off anyway unless stdout and stderr are terminals)")
    p.add_argument("--debug", action="store_true", help="show the traceback of a data or configuration error")
    for action in p._actions:
        if set(action.option_strings) & set(hidden):
            action.help = argparse.SUPPRESS
    args = p.parse_args(argv)
    for key, value in RECIPES[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out_heads is None:
        args.out_heads = 8 if args.dataset.lower() == "pubmed" else 1
    if args.K is None:
        args.K = 2 if args.model == "sgc" else 10
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = check_device(p, args.device).type == "cuda"
    try:
        args.num_neighbors = [int(k) for k in str(args.num_neighbors).split(",")]
    except ValueError:
        p.error(f"--num-neighbors must be comma-separated integers, got {args.num_neighbors!r}")
    check_values(p, args)
    if args.aggregation == "window" and args.model not in WINDOW_MODELS:
        p.error(f"--aggregation window runs spmm only: --model {args.model} needs other sparse ops "
                f"(window works with {', '.join(WINDOW_MODELS)})")
    if args.sampled and args.cuda_graph:
        p.error("--cuda-graph cannot capture sampled training (every batch has its own shapes)")
    if args.sampled:
        args.cuda_graph = False
    if args.cuda_graph and not on_cuda:
        p.error(f"--cuda-graph needs a CUDA device (--device is {args.device!r}: a CUDA graph captures CUDA work only)")
    if args.cuda_graph is None:
        args.cuda_graph = on_cuda
    return args


def check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a value that would crash later with a traceback (no
    epochs to summarise, torch.optim's own check, the loader's) or train something else
    than asked (a zero-width layer, a patience that stops after the first epoch)."""
    for flag, key in (("--epochs", "epochs"), ("--runs", "runs"), ("--hidden", "hidden"), ("--heads", "heads"),
                      ("--out-heads", "out_heads"), ("--patience", "patience"), ("--batch-size", "batch_size")):
        check_range(p, flag, getattr(args, key), low=1)
    check_range(p, "--K", args.K, low=0)
    check_range(p, "--lr", args.lr, low=0, low_open=True)
    check_range(p, "--weight-decay", args.weight_decay, low=0)
    check_range(p, "--dropout", args.dropout, low=0, high=1, high_open=True)
    check_range(p, "--alpha", args.alpha, low=0, high=1)
    if any(k < -1 for k in args.num_neighbors):
        p.error(f"--num-neighbors takes counts >= 0 (or -1: all), got {args.num_neighbors}")


def build_model(args: argparse.Namespace, data: NodeDataset) -> torch.nn.Module:
    features, classes, agg = data.num_features, data.num_classes, args.aggregation
    cached = not getattr(args, "sampled", False)  # a sampled batch is a new graph each time
    if args.model == "gcn":
        return GCN(features, args.hidden, classes, args.dropout, cached=cached, aggregation=agg)
    if args.model in ("gat", "gatv2"):
        return (GAT if args.model == "gat" else GATv2)(
            features, args.hidden, classes, heads=args.heads, out_heads=args.out_heads,
            dropout=args.dropout, aggregation=agg,
        )
    if args.model == "sage":
        return GraphSAGE(features, args.hidden, classes, args.dropout, aggr=args.aggr, aggregation=agg)
    if args.model == "gin":
        return GIN(features, args.hidden, classes, args.dropout, aggregation=agg)
    if args.model == "sgc":
        return SGC(features, classes, K=args.K, cached=cached, aggregation=agg)
    return APPNPNet(features, args.hidden, classes, K=args.K, alpha=args.alpha, dropout=args.dropout,
                    cached=cached, aggregation=agg)


PATH_LABELS = {
    "gas": "GAS (fused kernel, edge-parallel)",
    "gar": "GAR (fused kernel, row-parallel)",
    "window": "row windows (vector-sparse tensor-core kernel)",
    "reference": "reference (pure PyTorch)",
}
CPU_NOTE = (
    "on the CPU the pure-PyTorch reference path runs: the fused GAS / GAR kernels need CUDA, "
    "or Triton's interpreter (TRITON_INTERPRET=1 with --aggregation gas or gar; slow, for testing)"
)


@torch.no_grad()
def layer_paths(model: torch.nn.Module, data: NodeDataset, *, capture: bool) -> dict[str, list[Decision]]:
    """The paths each aggregating layer of ``model`` takes on ``data``, in the order its
    ops took them: one forward in ``model``'s mode, without gradients, as a training step
    runs it (``capture``: as it is captured into a CUDA graph, see
    :func:`fusegnn.sparse.dispatch.for_capture`)."""
    layers = {name: m for name, m in model.named_modules() if name and hasattr(m, "aggregation")}
    first: dict[str, int] = {}
    taken: dict[str, list[Decision]] = {}
    with for_capture(capture), decisions_taken() as log:
        hooks = []
        for name, layer in layers.items():
            hooks.append(layer.register_forward_pre_hook(lambda m, a, name=name: first.__setitem__(name, len(log))))
            hooks.append(layer.register_forward_hook(
                lambda m, a, out, name=name: taken.__setitem__(name, log[first[name]:])))
        try:
            model(data.x, data.graph)
        finally:
            for hook in hooks:
                hook.remove()
    return taken


def describe(decisions: list[Decision], layer: torch.nn.Module | None = None) -> str:
    """``label: reason`` of each distinct path in ``decisions`` (a layer's reference
    composition runs its inner ops on the reference too: said once). A ``layer`` that
    ran no sparse op because it reuses a cached propagation (SGC's ``cached=True``) is
    said to."""
    distinct: dict[str, Decision] = {}
    for decision in decisions:
        distinct.setdefault(decision.name, decision)
    if distinct:
        return "; then ".join(f"{PATH_LABELS.get(d.name, d.name)}: {d.reason}" for d in distinct.values())
    if getattr(layer, "cached", False):
        return "no sparse op (cached=True: the layer reuses the propagation of its first call)"
    return "no sparse op"


def path_report(args: argparse.Namespace, data: NodeDataset, device: torch.device) -> tuple[list[str], dict]:
    """The lines that say what runs, and ``{layer: path}`` for the summary."""
    model = build_model(args, data).to(device)
    model.train()
    train = layer_paths(model, data, capture=args.cuda_graph)
    model.eval()
    evaluation = layer_paths(model, data, capture=False)  # evaluation stays eager
    lines = [f"path of each layer (aggregation={args.aggregation}):"]
    for name, layer in model.named_modules():
        if name in train:
            line = f"  {name} {type(layer).__name__} -> {describe(train[name])}"
            if describe(evaluation[name]) != describe(train[name]):
                line += f" (training step); evaluation, eager -> {describe(evaluation[name], layer)}"
            lines.append(line)
    if device.type == "cpu" and all(d.name == "reference" for ds in train.values() for d in ds):
        lines.append(CPU_NOTE)
    elif device.type == "cpu":
        lines.append("the fused kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1): slow, for testing")
    return lines, {name: ds[0].name if ds else None for name, ds in train.items()}


@torch.no_grad()
def evaluate(model, data: NodeDataset) -> dict[str, float]:
    model.eval()
    logits = model(data.x, data.graph)
    result = {}
    for split in ("train", "val", "test"):
        mask = getattr(data, f"{split}_mask")
        result[f"{split}_acc"] = (logits[mask].argmax(-1) == data.y[mask]).float().mean().item()
        result[f"{split}_loss"] = F.cross_entropy(logits[mask], data.y[mask]).item()
    return result


class Selection:
    """The epoch whose metrics a run reports (best validation accuracy; ties: lower
    validation loss) and early stopping after ``patience`` epochs without a lower
    validation loss (``None``: never)."""

    def __init__(self, patience: int | None) -> None:
        self.patience = patience
        self.best: dict = {"val_acc": -1.0, "val_loss": float("inf")}
        self.best_val_loss, self.since_best = float("inf"), 0

    def update(self, metrics: dict[str, float], epoch: int, bar, *, run: int, loss: float, epochs: int) -> bool:
        """Take one epoch's metrics (and advance the progress ``bar``, to its end when
        stopping); ``True`` when training should stop."""
        if (metrics["val_acc"], -metrics["val_loss"]) > (self.best["val_acc"], -self.best["val_loss"]):
            self.best = dict(metrics, epoch=epoch)
        if metrics["val_loss"] < self.best_val_loss:
            self.best_val_loss, self.since_best = metrics["val_loss"], 0
        else:
            self.since_best += 1
        stop = self.patience is not None and self.since_best >= self.patience
        bar.update(1 + (epochs - epoch if stop else 0))
        bar.set_postfix(run=run, loss=f"{loss:.3f}", val=f"{metrics['val_acc']:.3f}")
        return stop


def sampled_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: NeighborLoader):
    """One epoch over ``loader``'s batches: the model on each batch's merged subgraph, the
    loss on its seeds (the first ``batch_size`` rows). Returns the mean training loss (a
    tensor, not read)."""

    def epoch() -> torch.Tensor:
        total, seeds = None, 0
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.graph)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y)
            loss.backward()
            optimizer.step()
            part = loss.detach() * batch.batch_size
            total = part if total is None else total + part
            seeds += batch.batch_size
        return total / seeds

    return epoch


def train_run(args: argparse.Namespace, data: NodeDataset, run: int, bar) -> dict[str, float]:
    torch.manual_seed(args.seed + run)
    model = build_model(args, data).to(data.x.device)
    optimizer = torch.optim.Adam(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, capturable=args.cuda_graph
    )
    # Index tensors, built once: the step gathers the training rows with fixed shapes.
    train_index = data.train_mask.nonzero().view(-1)
    graph = data.graph

    def train_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        # F.cross_entropy of the training rows' logits; fused into the output layer where
        # that pays (fusegnn.models.NodeClassifier.loss: GCN / GAT with fewer hidden
        # channels than classes, e.g. on Reddit): the [N, C] logits are then never written
        loss = model.loss(data.x, graph, data.y, train_index)
        loss.backward()
        optimizer.step()
        return loss

    if args.sampled:
        step = sampled_epoch(model, optimizer, NeighborLoader(
            data, args.num_neighbors, args.batch_size, input_nodes=train_index, shuffle=True,
            seed=args.seed + run,
        ))
    else:
        step = graphed_step(train_step, optimizer) if args.cuda_graph else train_step
    cuda = data.x.is_cuda
    selection = Selection(args.patience)
    epoch_ms = []
    for epoch in range(1, args.epochs + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.train()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        epoch_ms.append((time.perf_counter() - start) * 1e3)
        metrics = evaluate(model, data)
        if selection.update(metrics, epoch, bar, run=run, loss=loss.item(), epochs=args.epochs):
            break
    best = selection.best
    best["epoch_ms_median"] = statistics.median(epoch_ms)
    best["epochs_run"] = epoch
    return best


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    kwargs = {}
    if args.dataset.lower() in ("cora", "citeseer", "pubmed"):
        kwargs["normalize_features"] = not args.no_normalize_features
    try:
        check_device_present(device)
        data = load_dataset(args.dataset, args.root, **kwargs).to(device)
        reorder_s = None
        if args.reorder != "none":
            started = time.perf_counter()
            data = data.reorder(args.reorder)
            reorder_s = time.perf_counter() - started
        report, paths = path_report(args, data, device)
    except USER_ERRORS as err:
        fail(err, "train.py", debug=args.debug)
    if not args.quiet:
        steps = "training steps replayed as a CUDA graph" if args.cuda_graph else "eager training steps"
        print(f"{data}  on {device}  aggregation={args.aggregation}  ({steps})", file=sys.stderr)
        if reorder_s is not None:
            print(f"nodes renumbered in {args.reorder} order in {reorder_s:.1f} s", file=sys.stderr)
        print("\n".join(report), file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results = []
    bar = tqdm(total=args.runs * args.epochs, disable=not show_progress(args.quiet), desc=f"{args.model} {data.name}")
    with bar:
        for run in range(args.runs):
            results.append(train_run(args, data, run, bar))
    test = [r["test_acc"] for r in results]
    val = [r["val_acc"] for r in results]
    summary = {
        "dataset": data.name,
        "model": args.model,
        "runs": args.runs,
        "test_acc_mean": statistics.fmean(test),
        "test_acc_std": statistics.pstdev(test) if len(test) > 1 else 0.0,
        "val_acc_mean": statistics.fmean(val),
        "epoch_ms_median": statistics.median(r["epoch_ms_median"] for r in results),
        "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "aggregation": args.aggregation,
        "reorder": args.reorder,
        "paths": paths,
        "cuda_graph": args.cuda_graph,
        "sampled": {"num_neighbors": args.num_neighbors, "batch_size": args.batch_size} if args.sampled else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "best_epochs": [r["epoch"] for r in results],
        "test_accs": test,
    }
    if args.sampled:  # an epoch is one step per mini-batch (NeighborLoader keeps the last, smaller one)
        batches = -(-int(data.train_mask.sum()) // args.batch_size)
        timed = f"ms per training epoch ({batches} mini-batch steps)"
    else:
        timed = "ms per training step"
    print(
        f"{args.model.upper()} on {data.name}: test accuracy {summary['test_acc_mean']:.4f} "
        f"± {summary['test_acc_std']:.4f} (val {summary['val_acc_mean']:.4f}) over {args.runs} runs; "
        f"{summary['epoch_ms_median']:.2f} {timed}"
        + (f"; peak memory {summary['peak_mem_mib']:.0f} MiB" if summary["peak_mem_mib"] is not None else "")
    )
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
