r"""The Reddit post graph.

From "Inductive Representation Learning on Large Graphs" (Hamilton, Ying and Leskovec,
NeurIPS 2017). Nodes are Reddit posts of September 2014, an edge joins two posts that
the same user commented on, features are 602-dimensional (averaged GloVe embeddings of
the post plus its score and comment count) and the label is the post's community
(subreddit):

=======  ===========  ========  =======  =========================
nodes    edges        features  classes  train / val / test
=======  ===========  ========  =======  =========================
232,965  114,615,892  602       41       153,431 / 23,831 / 55,703
=======  ===========  ========  =======  =========================

The edge count is of directed edges: the graph is stored in both directions, without
self-loops; the mean degree is about 492.

Raw files
---------
The loader reads the two files of the DGL / PyG release,
``<root>/Reddit/raw/reddit_data.npz`` and ``<root>/Reddit/raw/reddit_graph.npz``:

* ``reddit_data.npz`` (:func:`numpy.savez`): ``feature`` ``[N, 602]`` floats, ``label``
  ``[N]`` integers, ``node_types`` ``[N]`` with ``1`` / ``2`` / ``3`` for
  train / validation / test (other keys are ignored);
* ``reddit_graph.npz``: an ``N x N`` adjacency written by :func:`scipy.sparse.save_npz`
  (COO; CSR / CSC are accepted too). Only the sparsity pattern is used. The file is
  read with :func:`numpy.load` directly (it is an ``.npz`` of plain arrays), so SciPy is
  not needed and the ``data`` array of 114M values is never read.

As in PyG, the edges are coalesced: sorted by source, then target, duplicates merged
(a file that is already coalesced is detected in one pass and not sorted again).
Everything is vectorised NumPy -> PyTorch: the full graph loads in seconds and takes
about 1.8 GB as an int64 ``edge_index``.

If the files are in none of the searched directories (see
:mod:`fusegnn.datasets.paths`), ``download=True`` fetches ``reddit.zip`` from the
usual location, https://data.dgl.ai/dataset/reddit.zip, and unpacks the two
files into ``<root>/Reddit/raw/`` (``root`` if given, else the cache; the folder is
created only once both files are unpacked); without network this ends in a
:class:`FileNotFoundError` that lists the files to put where.

:func:`fusegnn.datasets.synthetic.reddit_like` writes a graph of the same size and
shape in this layout, for machines without the data.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fusegnn.datasets import paths
from fusegnn.datasets.base import NodeDataset

__all__ = ["Reddit", "REDDIT_URL", "REDDIT_FILES", "read_reddit_raw", "coalesce_edge_index"]

#: Where the DGL / PyG release of the raw files lives (a zip of the two ``.npz`` files).
REDDIT_URL = "https://data.dgl.ai/dataset/reddit.zip"
#: The raw files, in ``<root>/Reddit/raw/``.
REDDIT_FILES = ("reddit_data.npz", "reddit_graph.npz")


def Reddit(  # noqa: N802 (named like PyG's class)
    root: str | os.PathLike | None = None,
    *,
    download: bool = True,
) -> NodeDataset:
    """Load Reddit as a :class:`~fusegnn.datasets.NodeDataset`.

    Args:
        root: base directory holding ``Reddit/raw/`` (or that folder itself, or its
            ``raw/``); it must exist. ``None`` searches ``$FUSEGNN_DATA`` and the cache
            (see :mod:`fusegnn.datasets.paths`).
        download: when no searched directory has both files, download and unpack
            :data:`REDDIT_URL` into ``root`` if given, else into the cache.

    Returns:
        ``x`` ``[N, 602]`` float32, ``y`` ``[N]`` int64, the coalesced ``edge_index``
        ``[2, E]`` int64 and the masks ``node_types == 1 / 2 / 3``.

    Raises:
        FileNotFoundError: the files are missing and could not be downloaded, or
            ``root`` does not exist.
        ValueError: the files are inconsistent (shapes, node ids, split codes).
    """
    directory = paths.find_dataset_dir(
        "Reddit", REDDIT_FILES, root, fetch=_download_reddit if download else None, source=REDDIT_URL,
        how_to_get=lambda missing: f"download {REDDIT_URL} and unzip {' and '.join(REDDIT_FILES)} from it",
    )
    raw = read_reddit_raw(directory)
    node_types = raw["node_types"]
    return NodeDataset(
        name="Reddit",
        x=raw["x"],
        y=raw["y"],
        edge_index=raw["edge_index"],
        train_mask=node_types == 1,
        val_mask=node_types == 2,
        test_mask=node_types == 3,
        num_classes=int(raw["y"].max()) + 1 if raw["y"].numel() else 0,
        extra={"root": str(directory)},
    )


def read_reddit_raw(directory: str | os.PathLike) -> dict[str, Tensor]:
    """Read ``reddit_data.npz`` and ``reddit_graph.npz`` from ``directory``.

    Returns a dict with ``x`` (float32), ``y`` (int64), ``node_types`` (int64) and the
    coalesced ``edge_index`` (int64).
    """
    directory = Path(directory)
    with np.load(directory / "reddit_data.npz") as data:
        missing = [k for k in ("feature", "label", "node_types") if k not in data.files]
        if missing:
            raise ValueError(
                f"{directory / 'reddit_data.npz'} lacks the key(s) {missing}; "
                f"it has {sorted(data.files)}"
            )
        x = torch.from_numpy(np.ascontiguousarray(data["feature"], dtype=np.float32))
        y = torch.from_numpy(np.asarray(data["label"]).astype(np.int64, copy=False))
        node_types = torch.from_numpy(np.asarray(data["node_types"]).astype(np.int64, copy=False))
    num_nodes = x.size(0)
    if x.dim() != 2 or y.shape != (num_nodes,) or node_types.shape != (num_nodes,):
        raise ValueError(
            f"reddit_data.npz: expected feature [N, F], label [N] and node_types [N], got "
            f"{tuple(x.shape)}, {tuple(y.shape)} and {tuple(node_types.shape)}"
        )
    if num_nodes and not bool(((node_types >= 1) & (node_types <= 3)).all()):
        raise ValueError("reddit_data.npz: node_types must be 1 (train), 2 (val) or 3 (test)")
    if num_nodes and int(y.min()) < 0:
        raise ValueError("reddit_data.npz: labels must be non-negative")
    edge_index = read_npz_adjacency(directory / "reddit_graph.npz", num_nodes)
    return {"x": x, "y": y, "node_types": node_types, "edge_index": edge_index}


def read_npz_adjacency(path: str | os.PathLike, num_nodes: int) -> Tensor:
    """The coalesced ``[2, E]`` int64 ``edge_index`` of a :func:`scipy.sparse.save_npz` file.

    Row ``i``, column ``j`` of the matrix is the edge ``i -> j``. Reads the index arrays
    with NumPy only (COO ``row``/``col`` or ``coords``, CSR / CSC ``indptr``/``indices``).
    """
    path = Path(path)
    with np.load(path) as arrays:
        if "format" not in arrays.files:
            raise ValueError(f"{path} is not a scipy.sparse .npz file (no 'format' entry)")
        fmt = arrays["format"].item()
        fmt = fmt.decode("ascii") if isinstance(fmt, bytes) else str(fmt)
        shape = tuple(int(s) for s in arrays["shape"])
        if fmt == "coo":
            if "row" in arrays.files:
                row, col = arrays["row"], arrays["col"]
            else:
                row, col = arrays["coords"]
        elif fmt in ("csr", "csc"):
            indptr, indices = arrays["indptr"], arrays["indices"]
            major = np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))
            row, col = (major, indices) if fmt == "csr" else (indices, major)
        else:
            raise ValueError(f"{path}: unsupported sparse format {fmt!r} (expected coo, csr or csc)")
    if shape != (num_nodes, num_nodes):
        raise ValueError(f"{path}: adjacency has shape {shape}, expected ({num_nodes}, {num_nodes})")
    edge_index = torch.stack(
        [torch.from_numpy(np.asarray(row)).to(torch.int64), torch.from_numpy(np.asarray(col)).to(torch.int64)]
    )
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"{path}: node ids out of range [0, {num_nodes})")
    return coalesce_edge_index(edge_index, num_nodes)


def coalesce_edge_index(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Sort ``edge_index`` by source, then target, and merge duplicate edges.

    Works on the keys ``source * num_nodes + target`` (int64); an input that is already
    strictly increasing is returned as is (no sort, no copy).
    """
    if edge_index.size(1) == 0:
        return edge_index.to(torch.int64)
    key = edge_index[0].to(torch.int64) * num_nodes + edge_index[1].to(torch.int64)
    if bool((key[1:] > key[:-1]).all()):
        return edge_index.to(torch.int64)
    key = torch.unique(key, sorted=True)
    row = torch.div(key, num_nodes, rounding_mode="floor")
    return torch.stack([row, key - row * num_nodes])


def _download_reddit(target: Path) -> None:
    """Download :data:`REDDIT_URL` and unpack the two raw files into ``target`` (created
    only once both are unpacked; see :func:`fusegnn.datasets.paths.staging_dir`)."""
    with paths.staging_dir(target) as tmp:
        archive = tmp / "reddit.zip"
        paths.fetch_url(REDDIT_URL, archive)
        with zipfile.ZipFile(archive) as zf:
            members = {Path(info.filename).name: info for info in zf.infolist() if not info.is_dir()}
            for name in REDDIT_FILES:
                if name not in members:
                    raise OSError(f"{REDDIT_URL} has no {name} (it holds {sorted(members)})")
                with zf.open(members[name]) as src, open(tmp / name, "wb") as dst:
                    while chunk := src.read(1 << 24):
                        dst.write(chunk)
        paths.move_into([tmp / name for name in REDDIT_FILES], target)
