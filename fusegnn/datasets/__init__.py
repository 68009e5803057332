"""Data loaders (Planetoid, Reddit, OGB) and generators for offline use."""

from fusegnn.datasets.base import NodeDataset

__all__ = ["NodeDataset"]
