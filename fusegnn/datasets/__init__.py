"""Data loaders (Planetoid, Reddit, OGB) and generators for offline use.

Every loader returns a :class:`NodeDataset` and looks for its files in ``root``, then
``$FUSEGNN_DATA``, then the cache directory, then downloads (see
:mod:`fusegnn.datasets.paths`). :func:`load_dataset` picks the loader by name.
"""

from __future__ import annotations

from typing import Any

from fusegnn.datasets.base import NodeDataset
from fusegnn.datasets.paths import ENV_VAR, cache_dir
from fusegnn.datasets.ogb import OGBNodeDataset
from fusegnn.datasets.planetoid import Planetoid
from fusegnn.datasets.reddit import Reddit
from fusegnn.datasets.synthetic import generate_ogbn_like, generate_reddit_like, ogbn_like, reddit_like

__all__ = [
    "DATASETS",
    "ENV_VAR",
    "NodeDataset",
    "OGBNodeDataset",
    "Planetoid",
    "Reddit",
    "cache_dir",
    "generate_ogbn_like",
    "generate_reddit_like",
    "load_dataset",
    "ogbn_like",
    "reddit_like",
]

#: Names accepted by :func:`load_dataset` (case-insensitive).
DATASETS = ("Cora", "CiteSeer", "PubMed", "Reddit", "ogbn-arxiv", "ogbn-products")


def load_dataset(name: str, root: str | None = None, **kwargs: Any) -> NodeDataset:
    """Load a data set by name: ``Cora``, ``CiteSeer``, ``PubMed`` (Planetoid),
    ``Reddit``, ``ogbn-arxiv``, ``ogbn-products``. ``kwargs`` go to the loader."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (one of {', '.join(DATASETS)}), got {type(name).__name__}")
    key = name.lower()
    if key in ("cora", "citeseer", "pubmed"):
        return Planetoid(root, name, **kwargs)
    if key == "reddit":
        return Reddit(root, **kwargs)
    if key in ("ogbn-arxiv", "ogbn-products"):
        return OGBNodeDataset(key, root, **kwargs)
    raise ValueError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
