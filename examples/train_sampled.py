"""Train GraphSAGE on sampled mini-batches (neighbour sampling on the GPU).

    python examples/train_sampled.py --dataset Reddit --device cuda
    python examples/train_sampled.py --dataset ogbn-products --num-neighbors 15,10,5 --device cuda
    python examples/train_sampled.py --dataset Reddit --synthetic --scale 0.01 --avg-degree 20   # no data needed

Each epoch draws batches of ``--batch-size`` training nodes with
:class:`fusegnn.loader.NeighborLoader` (``--num-neighbors`` incoming neighbours per hop,
uniformly without replacement) and trains a GraphSAGE model (mean aggregation, hidden
``--hidden``, one layer per hop) layer by layer on the batch's bipartite blocks: layer
``l`` maps the features of ``blocks[l]``'s sources to its targets, the first
``num_dst_nodes`` of the sources, so the last layer's outputs are the seeds'.
Evaluation is full-graph and layer-wise (every node's full neighbourhood, one layer at a
time), the model selected on validation accuracy.

``--synthetic`` generates a data set of the real one's shape
(:mod:`fusegnn.datasets.synthetic`: Reddit-like, ogbn-products-like) instead of loading
it. ``--pin-features`` keeps the features in CPU memory (rows of each batch copied from
pinned memory), for graphs whose features do not fit on the GPU. With ``--json`` the last
line printed is a JSON summary.

Data is looked for in ``--root``, then ``$FUSEGNN_DATA``, then ``~/.cache/fusegnn``, then
downloaded. A missing data set or a ``--root`` that does not exist is one message and exit
status 2 (``--debug`` shows the traceback), as in ``examples/train.py``.
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
from torch import Tensor, nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_cli.py, imported below
try:
    import fusegnn  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import USER_ERRORS, check_device, check_device_present, check_range, fail, show_progress  # noqa: E402

from fusegnn.datasets import NodeDataset, cache_dir, generate_ogbn_like, generate_reddit_like, load_dataset
from fusegnn.datasets.synthetic import OGBN_SPECS
from fusegnn.loader import NeighborLoader
from fusegnn.layers import SAGEConv
from fusegnn.sparse import Graph


class SAGE(nn.Module):
    """``num_layers`` mean-aggregation SAGE layers, ReLU and dropout between them."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, num_layers: int = 2, dropout: float = 0.5):
        super().__init__()
        widths = [in_channels] + [hidden] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(SAGEConv(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.dropout = dropout

    def forward(self, x: Tensor, blocks: list[Graph]) -> Tensor:
        """Outputs of the last block's targets (a sampled batch's seeds)."""
        if len(blocks) != len(self.convs):  # zip would drop layers or blocks without a word
            raise ValueError(f"{len(self.convs)} layers need one block each, got {len(blocks)} blocks "
                             "(num_neighbors must have one fanout per layer)")
        for k, (conv, block) in enumerate(zip(self.convs, blocks)):
            x = conv((x, x[: block.num_dst_nodes]), block)
            if k < len(self.convs) - 1:
                x = F.dropout(F.relu(x), self.dropout, self.training)
        return x

    @torch.no_grad()
    def inference(self, x: Tensor, graph: Graph) -> Tensor:
        """Every node's output over its full neighbourhood, one layer at a time."""
        return self.forward(x, [graph] * len(self.convs))


def train_epoch(model: nn.Module, loader: NeighborLoader, optimizer: torch.optim.Optimizer, *,
                progress: bool = False) -> float:
    """One pass over the loader's batches; returns the mean training loss."""
    model.train()
    total, count = torch.zeros((), device=loader.device), 0
    for batch in tqdm(loader, desc="train", leave=False, disable=not progress):
        optimizer.zero_grad(set_to_none=True)
        out = model(batch.x, batch.blocks)
        loss = F.cross_entropy(out, batch.y)
        loss.backward()
        optimizer.step()
        total += loss.detach() * batch.batch_size
        count += batch.batch_size
    return float(total) / max(count, 1)


@torch.no_grad()
def evaluate(model: SAGE, data: NodeDataset, graph: Graph, x: Tensor) -> dict[str, float]:
    """Accuracy on the train / val / test masks by full-graph layer-wise inference."""
    model.eval()
    pred = model.inference(x, graph).argmax(1).cpu()
    y = data.y.cpu()
    return {name: float((pred[mask] == y[mask]).float().mean())
            for name, mask in (("train", data.train_mask.cpu()), ("val", data.val_mask.cpu()),
                               ("test", data.test_mask.cpu()))}


def load(args: argparse.Namespace, device: torch.device) -> NodeDataset:
    key = args.dataset.lower()
    if args.synthetic:
        build = device if device.type == "cuda" else torch.device("cpu")
        if key == "reddit":
            return generate_reddit_like(args.scale, args.seed, build, avg_degree=args.avg_degree)
        return generate_ogbn_like(key, args.scale, args.seed, build, avg_degree=args.avg_degree)
    return load_dataset(args.dataset, args.root)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="Reddit", help="Reddit, ogbn-products, ogbn-arxiv, Cora, ...")
    p.add_argument("--root", help=f"data root, <root>/<Name>/raw (else $FUSEGNN_DATA, else the cache {cache_dir()}, "
                                  "else a download into the cache)")
    p.add_argument("--synthetic", action="store_true", help="generate a data set of the same shape (Reddit / ogbn-*)")
    p.add_argument("--scale", type=float, default=1.0, help="--synthetic: fraction of the real node count")
    p.add_argument("--avg-degree", type=float, help="--synthetic: edges per node (default: the real one's)")
    p.add_argument("--num-neighbors", default="25,10", help="fanout per hop, from the seeds (default 25,10)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs (0: only at the end)")
    p.add_argument("--pin-features", action="store_true", help="keep features in pinned CPU memory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (it is off anyway unless stdout and stderr are terminals)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--debug", action="store_true", help="show the traceback of a data or configuration error")
    args = p.parse_args(argv)
    try:
        args.num_neighbors = [int(part) for part in args.num_neighbors.split(",") if part.strip()]
    except ValueError:
        p.error(f"--num-neighbors must be comma-separated integers, got {args.num_neighbors!r}")
    if not args.num_neighbors:
        p.error("--num-neighbors needs at least one hop")
    if any(k < -1 for k in args.num_neighbors):
        p.error(f"--num-neighbors takes counts >= 0 (or -1: all), got {args.num_neighbors}")
    for flag, key in (("--epochs", "epochs"), ("--batch-size", "batch_size"), ("--hidden", "hidden")):
        check_range(p, flag, getattr(args, key), low=1)
    check_range(p, "--eval-every", args.eval_every, low=0)
    check_range(p, "--lr", args.lr, low=0, low_open=True)
    check_range(p, "--dropout", args.dropout, low=0, high=1, high_open=True)
    check_device(p, args.device)
    if args.synthetic and _synthetic_key(args.dataset) is None:
        p.error(f"--synthetic generates Reddit, ogbn-arxiv or ogbn-products, not {args.dataset!r}")
    return args


def _synthetic_key(dataset: str) -> str | None:
    """``"reddit"``, an ``OGBN_SPECS`` name, or ``None`` for a data set ``--synthetic``
    cannot generate."""
    key = dataset.lower().replace("_", "-")
    if key == "reddit":
        return key
    key = key if key.startswith("ogbn-") else f"ogbn-{key}"
    return key if key in OGBN_SPECS else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    fanouts = args.num_neighbors
    try:
        check_device_present(device)
        data = load(args, device)
    except USER_ERRORS as err:
        fail(err, "train_sampled.py", debug=args.debug)
    graph = data.graph.to(device)
    loader = NeighborLoader(
        graph, fanouts, args.batch_size, data.train_mask, x=data.x, y=data.y, shuffle=True,
        seed=args.seed, device=device, pin_features=args.pin_features,
    )
    x_eval = data.x.to(device)  # layer-wise inference reads every node's features
    model = SAGE(data.num_features, args.hidden, data.num_classes, len(fanouts), args.dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    layer = type(model.convs[0]).__name__
    print(f"{data.name}: {data.num_nodes} nodes, {data.num_edges} edges; {len(loader)} batches of "
          f"{args.batch_size}, fanouts {fanouts}; layer {layer} on {device}", file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epoch_s, losses, best = [], [], {"val": -1.0}
    progress = show_progress(args.quiet)
    for epoch in range(1, args.epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = train_epoch(model, loader, optimizer, progress=progress)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        epoch_s.append(time.perf_counter() - t0)
        losses.append(loss)
        line = f"epoch {epoch:3d}  loss {loss:.4f}  {epoch_s[-1]:.2f} s"
        if (args.eval_every and epoch % args.eval_every == 0) or epoch == args.epochs:
            acc = evaluate(model, data, graph, x_eval)
            if acc["val"] > best["val"]:
                best = dict(acc, epoch=epoch)
            line += f"  train {acc['train']:.4f}  val {acc['val']:.4f}  test {acc['test']:.4f}"
        print(line, file=sys.stderr)
    summary = {
        "dataset": data.name, "synthetic": bool(args.synthetic), "layer": layer, "num_neighbors": fanouts,
        "batch_size": args.batch_size, "hidden": args.hidden, "epochs": args.epochs, "losses": losses,
        "epoch_s_median": statistics.median(epoch_s), "best_epoch": best.get("epoch"),
        "val_acc": best["val"], "test_acc": best.get("test"),
        "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
