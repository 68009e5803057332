"""The data sets the cases run on, loaded once per run and kept on the device.

* ``cora``, ``citeseer``: :func:`fusegnn.datasets.planetoid.Planetoid` from the raw files.
* ``pubmed``: the same loader; where ``ind.pubmed.allx`` is missing (the offline copy
  this project ships lacks it) the graph, labels and public split are read from the
  files that are there and the features are **random** of the real width 500
  (timings do not depend on feature values; the record of the data set says so).
* ``reddit``: Reddit-like, generated in memory on the device by
  :func:`fusegnn.datasets.synthetic.generate_reddit_like` (232,965 nodes and
  114,615,892 edges at ``scale=1``).
* ``arxiv``: ogbn-arxiv-like, generated the same way by
  :func:`fusegnn.datasets.synthetic.generate_ogbn_like` (169,343 nodes, 128 features, 40
  classes, about 2.3M edges after symmetrisation at ``scale=1``).

:class:`DatasetCache` keeps one data set at a time (cases are ordered by data set), so
Reddit-like is generated once per suite and freed before anything else is loaded.
"""

from __future__ import annotations

import gc
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fusegnn.datasets.base import NodeDataset

__all__ = ["DataConfig", "DatasetCache", "load_benchmark_dataset"]

_PLANETOID = {"cora": "Cora", "pubmed": "PubMed", "citeseer": "CiteSeer"}
_PUBMED_FEATURES = 500


@dataclass(frozen=True)
class DataConfig:
    """Where and how data sets are made.

    Attributes:
        root: base directory of the Planetoid raw files (``<root>/<Name>/raw``).
        device: where every tensor goes.
        scale: size of the generated graphs (Reddit-like, arxiv-like) as a fraction of
            the real one's nodes.
        avg_degree: Reddit-like directed edges per node (``None``: Reddit's, about 492;
            tiny scales need a smaller one).
        seed: seed of generated graphs and random features.
    """

    root: str | None
    device: torch.device
    scale: float = 1.0
    avg_degree: float | None = None
    seed: int = 0


def load_benchmark_dataset(name: str, config: DataConfig) -> tuple[NodeDataset, str]:
    """``(data set on config.device, one line saying where it came from)``."""
    key = name.lower()
    if key in _PLANETOID:
        data, source = _load_planetoid(_PLANETOID[key], config)
    elif key == "reddit":
        from fusegnn.datasets.synthetic import generate_reddit_like

        kwargs = {} if config.avg_degree is None else {"avg_degree": config.avg_degree}
        data = generate_reddit_like(config.scale, config.seed, config.device, **kwargs)
        degree = "Reddit's average degree" if config.avg_degree is None else f"avg degree {config.avg_degree:g}"
        source = f"synthetic Reddit-like (generate_reddit_like, scale {config.scale:g}, {degree}, seed {config.seed})"
    elif key == "arxiv":
        from fusegnn.datasets.synthetic import generate_ogbn_like

        data = generate_ogbn_like("arxiv", config.scale, config.seed, config.device)
        source = f"synthetic ogbn-arxiv-like (generate_ogbn_like, scale {config.scale:g}, seed {config.seed})"
    else:
        raise ValueError(f"unknown benchmark data set {name!r}; known: cora, citeseer, pubmed, arxiv, reddit")
    return data.to(config.device), source


def _load_planetoid(name: str, config: DataConfig) -> tuple[NodeDataset, str]:
    from fusegnn.datasets.planetoid import Planetoid

    try:
        return Planetoid(config.root, name, download=False), "Planetoid raw files"
    except FileNotFoundError:
        if name != "PubMed":
            raise
        data = _pubmed_without_allx(config)
        return data, (
            "Planetoid raw files: graph, labels and public split; features RANDOM "
            f"(standard normal, width {_PUBMED_FEATURES}) because ind.pubmed.allx is missing"
        )


def _pubmed_without_allx(config: DataConfig) -> NodeDataset:
    """PubMed's graph, labels and public split from the files other than ``allx``, with
    random features of the real width (same node numbering as the full loader)."""
    from fusegnn.datasets.paths import find_dataset_dir

    files = [f"ind.pubmed.{ext}" for ext in ("y", "ally", "ty", "graph", "test.index")]
    directory = find_dataset_dir("PubMed", files, config.root, subdir="raw")
    y_train = np.asarray(_load_plain_pickle(directory / "ind.pubmed.y"))
    ally = np.asarray(_load_plain_pickle(directory / "ind.pubmed.ally"))
    ty = np.asarray(_load_plain_pickle(directory / "ind.pubmed.ty"))
    graph = _load_plain_pickle(directory / "ind.pubmed.graph")
    test_index = np.loadtxt(directory / "ind.pubmed.test.index", dtype=np.int64).reshape(-1)
    num_other = ally.shape[0]
    num_nodes = int(test_index.max()) + 1
    if int(test_index.min()) != num_other or not isinstance(graph, dict):
        raise ValueError(f"{directory}: PubMed files are not in the expected layout")
    onehot = np.zeros((num_nodes, ally.shape[1]), dtype=np.float32)
    onehot[:num_other] = ally
    onehot[test_index] = ty
    y = torch.from_numpy(onehot.argmax(axis=1).astype(np.int64))

    src = np.repeat(np.fromiter(graph.keys(), dtype=np.int64), [len(v) for v in graph.values()])
    dst = np.fromiter((int(n) for v in graph.values() for n in v), dtype=np.int64)
    keep = src != dst
    key = np.unique(dst[keep] * num_nodes + src[keep])  # coalesced, sorted by target then source
    edge_index = torch.from_numpy(np.stack([key % num_nodes, key // num_nodes]))

    generator = torch.Generator().manual_seed(config.seed)
    x = torch.randn(num_nodes, _PUBMED_FEATURES, generator=generator)

    def mask(index: np.ndarray) -> torch.Tensor:
        m = torch.zeros(num_nodes, dtype=torch.bool)
        m[torch.from_numpy(np.asarray(index, dtype=np.int64))] = True
        return m

    num_train = y_train.shape[0]
    return NodeDataset(
        name="PubMed",
        x=x,
        y=y,
        edge_index=edge_index,
        train_mask=mask(np.arange(num_train)),
        val_mask=mask(np.arange(num_train, num_train + 500)),
        test_mask=mask(test_index),
        num_classes=int(ally.shape[1]),
        extra={"random_features": True, "raw_dir": str(directory)},
    )


_ALLOWED = {
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("collections", "defaultdict"),
    ("__builtin__", "list"),
    ("builtins", "list"),
    ("__builtin__", "dict"),
    ("builtins", "dict"),
}


class _PlainUnpickler(pickle.Unpickler):
    """Admits only the NumPy arrays, dicts and lists the label / graph files hold."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a Planetoid file")
        if name == "_reconstruct":
            try:
                from numpy._core import multiarray
            except ImportError:  # NumPy < 2
                from numpy.core import multiarray
            return multiarray._reconstruct
        if module == "__builtin__":
            module = "builtins"
        return super().find_class(module, name)


def _load_plain_pickle(path: Path) -> Any:
    with open(path, "rb") as handle:
        return _PlainUnpickler(handle, encoding="latin1").load()


class DatasetCache:
    """Holds the data set of the current case; loading another frees the previous one.

    ``sources`` maps each data set loaded so far to a summary (sizes and where it came
    from), written into the results.
    """

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self._name: str | None = None
        self._data: NodeDataset | None = None
        self.sources: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> NodeDataset:
        key = name.lower()
        if self._name != key:
            self.release()
            data, source = load_benchmark_dataset(key, self.config)
            self._name, self._data = key, data
            self.sources[key] = {
                "name": data.name,
                "nodes": data.num_nodes,
                "edges": data.num_edges,
                "features": data.num_features,
                "classes": data.num_classes,
                "source": source,
            }
        assert self._data is not None
        return self._data

    def release(self) -> None:
        self._name, self._data = None, None
        gc.collect()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()
