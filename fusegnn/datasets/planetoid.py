r"""The Planetoid citation graphs: Cora, CiteSeer and PubMed.

From "Revisiting Semi-Supervised Learning with Graph Embeddings" (Yang, Cohen and
Salakhutdinov, ICML 2016); the citation data come from Sen et al. (2008). Nodes are
documents, edges citations (stored in both directions), features bag-of-words
(Cora, CiteSeer: binary; PubMed: TF-IDF) and labels the document's topic.

Raw files
---------
The loader reads the eight standard files ``<root>/<Name>/raw/ind.<name>.<ext>``
(``<name>`` lower case), exactly as PyG's ``read_planetoid_data`` (and Kipf's GCN code)
do:

* ``x``, ``y``: features / one-hot labels of the labelled training nodes (the first
  ``len(y)`` node ids);
* ``allx``, ``ally``: features / labels of every non-test node, ids
  ``0 .. len(allx) - 1`` (``x`` is its first ``len(x)`` rows);
* ``tx``, ``ty``: features / labels of the test nodes; row ``i`` belongs to node
  ``test.index[i]``;
* ``test.index``: the test node ids, one per line, in ``tx`` order;
* ``graph``: a ``dict`` node -> list of neighbours.

``x``/``tx``/``allx`` are pickled ``scipy.sparse`` matrices, so reading them needs
SciPy (``pip install scipy``). The pickles are read with an unpickler that only admits
the NumPy / SciPy / builtin types these files consist of, so a tampered download cannot
run code.

CiteSeer has 15 node ids inside the test-id range that are not in ``test.index``
(usually called "isolated test ids": documents that appear in the citation graph, with
their edges, but whose features and labels are not in the files). As usual they are kept
as nodes with all-zero features and label ``0`` (CiteSeer has 3327 nodes); they are in no
split mask, and ``extra["padded_mask"]`` marks them.

The edge list is the ``graph`` dict with self-loops removed and duplicates merged,
sorted by target then source (PyG's ``coalesce(..., sort_by_row=False)`` order):

=========  =======  ==============  ========  =======  ======================
name       nodes    directed edges  features  classes  public train/val/test
=========  =======  ==============  ========  =======  ======================
Cora       2,708    10,556          1,433     7        140 / 500 / 1000
CiteSeer   3,327    9,104           3,703     6        120 / 500 / 1000
PubMed     19,717   88,648          500       3        60 / 500 / 1000
=========  =======  ==============  ========  =======  ======================

Splits
------
* ``"public"``: Planetoid's fixed split: train = nodes ``0 .. len(y) - 1`` (20 per
  class), validation = the next 500 ids, test = ``test.index``.
* ``"full"``: validation and test as in ``"public"``, every other (non-padded) node
  trains (FastGCN's setting).
* ``"random"``: ``num_train_per_class`` random nodes of each class train (all of a class
  if it has fewer), then ``num_val`` and ``num_test`` random nodes of the rest, drawn
  with a ``torch.Generator`` seeded with ``seed``.

Padded CiteSeer nodes are never in a mask (PyG puts them in the ``"full"`` and
``"random"`` masks with their placeholder label 0; otherwise the masks equal PyG's).
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fusegnn.datasets import paths
from fusegnn.datasets.base import NodeDataset

__all__ = [
    "Planetoid",
    "PLANETOID_NAMES",
    "PLANETOID_SPLITS",
    "PLANETOID_URL",
    "planetoid_raw_file_names",
    "read_planetoid_raw",
]

PLANETOID_NAMES: tuple[str, ...] = ("Cora", "CiteSeer", "PubMed")
PLANETOID_SPLITS: tuple[str, ...] = ("public", "full", "random")
PLANETOID_URL = "https://github.com/kimiyoung/planetoid/raw/master/data"
_EXTENSIONS: tuple[str, ...] = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
_NUM_PUBLIC_VAL = 500


def Planetoid(  # noqa: N802 (named like PyG's class)
    root: str | os.PathLike | None = None,
    name: str = "Cora",
    split: str = "public",
    normalize_features: bool = False,
    *,
    num_train_per_class: int = 20,
    num_val: int = 500,
    num_test: int = 1000,
    seed: int = 0,
    download: bool = True,
) -> NodeDataset:
    r"""Load Cora, CiteSeer or PubMed from the raw Planetoid files.

    Args:
        root: base directory holding ``<Name>/raw/ind.<name>.*`` (or that folder
            itself, or its ``raw/``); it must exist. Searched first, then
            ``$FUSEGNN_DATA``, then the cache (``~/.cache/fusegnn``); see
            :mod:`fusegnn.datasets.paths`.
        name: ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"`` (any letter case).
        split: ``"public"``, ``"full"`` or ``"random"`` (see the module docstring).
        normalize_features: divide every feature row by its sum,
            :math:`x_i \leftarrow x_i / \sum_f x_{if}`, so each row sums to 1; all-zero
            rows stay zero (Kipf and Welling's preprocessing; PyG's ``NormalizeFeatures``
            agrees on Cora / CiteSeer but leaves rows whose sum is below 1 alone).
        num_train_per_class, num_val, num_test: sizes of the ``"random"`` split.
        seed: seed of the ``"random"`` split.
        download: when no searched directory has all eight files, download the ones
            missing there from the Planetoid repository (:data:`PLANETOID_URL`) into
            ``root`` if given, else into the cache (never into ``$FUSEGNN_DATA``). With
            ``False`` (or without network) a :class:`FileNotFoundError` says which
            files to put where.

    Returns:
        A :class:`~fusegnn.datasets.NodeDataset` with float32 features, int64 labels, the
        coalesced edge list and the split masks. ``extra`` holds ``"raw_dir"`` (the
        directory read), ``"split"`` and ``"padded_mask"`` (``[N]`` bool, the
        zero-feature placeholder nodes of CiteSeer; all ``False`` otherwise).

    Raises:
        ValueError: unknown ``name`` or ``split``, bad split sizes, or malformed files.
        FileNotFoundError: files missing and not downloadable (names the missing files),
            or ``root`` does not exist.
        ImportError: SciPy is not installed.
    """
    canonical = _canonical_name(name)
    split_key = _check_split(split)
    for arg, value in (("num_train_per_class", num_train_per_class), ("num_val", num_val),
                       ("num_test", num_test), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{arg} must be a non-negative int, got {value!r}")

    directory = _find_raw_dir(canonical, root, download)
    raw = read_planetoid_raw(directory, canonical)

    x = raw["x"]
    if normalize_features:
        x = _row_normalize(x)
    y, padded = raw["y"], raw["padded_mask"]
    num_nodes = y.numel()
    train = _index_to_mask(raw["train_index"], num_nodes)
    val = _index_to_mask(raw["val_index"], num_nodes)
    test = _index_to_mask(raw["test_index"], num_nodes)
    num_classes = int(raw["num_classes"])

    if split_key == "full":
        train = ~(val | test | padded)
    elif split_key == "random":
        train, val, test = _random_split(
            y, padded, num_classes, int(num_train_per_class), int(num_val), int(num_test), int(seed)
        )

    return NodeDataset(
        name=canonical,
        x=x,
        y=y,
        edge_index=raw["edge_index"],
        train_mask=train,
        val_mask=val,
        test_mask=test,
        num_classes=num_classes,
        extra={"raw_dir": str(directory), "split": split_key, "padded_mask": padded},
    )


def planetoid_raw_file_names(name: str) -> list[str]:
    """The eight raw file names of a Planetoid data set, e.g. ``ind.cora.x``."""
    prefix = _canonical_name(name).lower()
    return [f"ind.{prefix}.{ext}" for ext in _EXTENSIONS]


def read_planetoid_raw(directory: str | os.PathLike, name: str) -> dict[str, Any]:
    """Parse the raw files in ``directory`` (no split logic, no normalisation).

    Returns a dict with ``x`` (``[N, F]`` float32), ``y`` (``[N]`` int64),
    ``edge_index`` (``[2, E]`` int64, coalesced, no self-loops), ``train_index``,
    ``val_index``, ``test_index`` (the public split, int64 ids), ``padded_mask``
    (``[N]`` bool) and ``num_classes``.
    """
    prefix = _canonical_name(name).lower()
    directory = Path(directory)

    def path(ext: str) -> Path:
        return directory / f"ind.{prefix}.{ext}"

    x_train = _dense(_load_pickle(path("x")), path("x"))
    y_train = _dense(_load_pickle(path("y")), path("y"))
    allx = _dense(_load_pickle(path("allx")), path("allx"))
    ally = _dense(_load_pickle(path("ally")), path("ally"))
    tx = _dense(_load_pickle(path("tx")), path("tx"))
    ty = _dense(_load_pickle(path("ty")), path("ty"))
    graph = _load_pickle(path("graph"))
    test_index = _read_index_file(path("test.index"))

    num_labelled, num_other, num_test = y_train.shape[0], allx.shape[0], test_index.size
    num_features, num_classes = allx.shape[1], ally.shape[1]
    _check(x_train.shape == (num_labelled, num_features), path("x"),
           f"shape {x_train.shape}, expected ({num_labelled}, {num_features})")
    _check(y_train.shape[1] == num_classes, path("y"), f"{y_train.shape[1]} classes, ally has {num_classes}")
    _check(ally.shape[0] == num_other, path("ally"), f"{ally.shape[0]} rows, allx has {num_other}")
    _check(tx.shape == (num_test, num_features), path("tx"),
           f"shape {tx.shape}, expected ({num_test}, {num_features})")
    _check(ty.shape == (num_test, num_classes), path("ty"),
           f"shape {ty.shape}, expected ({num_test}, {num_classes})")
    _check(num_test > 0 and np.unique(test_index).size == num_test, path("test.index"),
           "must list distinct node ids")
    _check(int(test_index.min()) == num_other, path("test.index"),
           f"smallest test id {int(test_index.min())} should follow the {num_other} rows of allx")
    _check(num_labelled + _NUM_PUBLIC_VAL <= num_other, path("y"),
           f"{num_labelled} labelled nodes leave no room for {_NUM_PUBLIC_VAL} validation nodes")
    _check(isinstance(graph, dict), path("graph"), f"must hold a dict, got {type(graph).__name__}")

    # Test ids are num_other .. max(test.index); ids in that range missing from
    # test.index (CiteSeer's isolated documents) stay all-zero placeholder rows.
    num_nodes = int(test_index.max()) + 1
    features = np.zeros((num_nodes, num_features), dtype=np.float32)
    features[:num_other] = allx
    features[test_index] = tx
    onehot = np.zeros((num_nodes, num_classes), dtype=np.float32)
    onehot[:num_other] = ally
    onehot[test_index] = ty
    labels = onehot.argmax(axis=1)  # first maximum; placeholder rows get 0 as in PyG

    padded = np.ones(num_nodes, dtype=bool)
    padded[:num_other] = False
    padded[test_index] = False

    return {
        "x": torch.from_numpy(features),
        "y": torch.from_numpy(labels.astype(np.int64)),
        "edge_index": _edge_index_from_dict(graph, num_nodes, path("graph")),
        "train_index": torch.arange(num_labelled, dtype=torch.long),
        "val_index": torch.arange(num_labelled, num_labelled + _NUM_PUBLIC_VAL, dtype=torch.long),
        "test_index": torch.from_numpy(np.sort(test_index)),
        "padded_mask": torch.from_numpy(padded),
        "num_classes": num_classes,
    }


# ----------------------------------------------------------------------------- names


def _canonical_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for canonical in PLANETOID_NAMES:
        if name.lower() == canonical.lower():
            return canonical
    raise ValueError(f"Unknown Planetoid data set name={name!r}; valid names: {', '.join(PLANETOID_NAMES)}")


def _check_split(split: str) -> str:
    if not isinstance(split, str) or split.lower() not in PLANETOID_SPLITS:
        raise ValueError(
            f"Unknown Planetoid split={split!r}; valid splits: {', '.join(PLANETOID_SPLITS)} "
            "(PyG's 'geom-gcn' splits are not supported)"
        )
    return split.lower()


# ----------------------------------------------------------------------------- files


def _find_raw_dir(name: str, root: str | os.PathLike | None, download: bool) -> Path:
    """The folder with the eight raw files (downloading the missing ones if allowed);
    otherwise one :class:`FileNotFoundError` naming the files missing where."""
    files = planetoid_raw_file_names(name)

    def fetch(target: Path) -> None:
        missing = [f for f in files if not (target / f).is_file()]
        paths.download_files({f: f"{PLANETOID_URL}/{f}" for f in missing}, target)

    def how_to_get(missing: Sequence[str]) -> str:
        if len(missing) < len(files):
            return "download " + ", ".join(f"{PLANETOID_URL}/{f}" for f in missing)
        return f"download each file from {PLANETOID_URL}/<file name>"

    return paths.find_dataset_dir(
        name, files, root, subdir="raw", fetch=fetch if download else None,
        source=f"{PLANETOID_URL}/ind.{name.lower()}.*", how_to_get=how_to_get,
    )


def _read_index_file(path: Path) -> np.ndarray:
    try:
        text = path.read_text().split()
        index = np.asarray([int(token) for token in text], dtype=np.int64)
    except ValueError as exc:
        raise ValueError(f"{path}: expected one integer node id per line ({exc})") from None
    _check(index.size > 0 and int(index.min()) >= 0, path, "must list non-negative node ids")
    return index


_ALLOWED_GLOBALS = {
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("collections", "defaultdict"),
    ("__builtin__", "list"),
    ("builtins", "list"),
    ("__builtin__", "dict"),
    ("builtins", "dict"),
}
_SPARSE_CLASSES = {"csr_matrix", "csc_matrix", "coo_matrix", "lil_matrix"}


def _resolve_global(module: str, name: str) -> Any:
    if module.startswith("scipy.sparse") and name in _SPARSE_CLASSES:
        import scipy.sparse  # already imported by _load_pickle

        return getattr(scipy.sparse, name)  # avoids the deprecated scipy.sparse.csr path
    if (module, name) not in _ALLOWED_GLOBALS:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a Planetoid file")
    if name == "_reconstruct" or name == "scalar":
        try:
            from numpy._core import multiarray
        except ImportError:  # NumPy < 2
            from numpy.core import multiarray
        return getattr(multiarray, name)
    return None  # resolved by the standard unpickler


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        resolved = _resolve_global(module, name)
        return resolved if resolved is not None else super().find_class(module, name)


def _load_pickle(path: Path) -> Any:
    try:
        import scipy.sparse  # noqa: F401  (the features are pickled scipy.sparse matrices)
    except ImportError as exc:
        raise ImportError(
            "Reading the Planetoid raw files needs SciPy (their features are pickled "
            "scipy.sparse matrices): pip install scipy"
        ) from exc
    with open(path, "rb") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return _RestrictedUnpickler(handle, encoding="latin1").load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a valid Planetoid file: {exc}") from None


def _dense(obj: Any, path: Path) -> np.ndarray:
    array = obj.toarray() if hasattr(obj, "toarray") else obj
    _check(isinstance(array, np.ndarray) and array.ndim == 2, path, "must hold a 2-D matrix")
    return np.asarray(array, dtype=np.float32)


def _check(condition: bool, path: Path, message: str) -> None:
    if not condition:
        raise ValueError(f"{path}: {message}")


# ----------------------------------------------------------------------------- graph


def _edge_index_from_dict(graph: dict, num_nodes: int, path: Path) -> Tensor:
    """Edges ``key -> neighbour`` of the adjacency dict, self-loops removed, coalesced.

    Sorted by target, then source (PyG's ``coalesce(..., sort_by_row=False)``).
    """
    counts = np.fromiter((len(v) for v in graph.values()), dtype=np.int64, count=len(graph))
    src = np.repeat(np.fromiter(graph.keys(), dtype=np.int64, count=len(graph)), counts)
    dst = np.fromiter((int(n) for v in graph.values() for n in v), dtype=np.int64, count=int(counts.sum()))
    if src.size:
        low, high = min(src.min(), dst.min()), max(src.max(), dst.max())
        _check(low >= 0 and high < num_nodes, path, f"node ids must lie in [0, {num_nodes}), got [{low}, {high}]")
    keep = src != dst
    key = np.unique(dst[keep] * num_nodes + src[keep])  # sorted, duplicates merged
    return torch.from_numpy(np.stack([key % num_nodes, key // num_nodes]))


# ----------------------------------------------------------------------------- features / splits


def _row_normalize(x: Tensor) -> Tensor:
    row_sum = x.sum(dim=1, keepdim=True)
    return x / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)


def _index_to_mask(index: Tensor, size: int) -> Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    mask[index] = True
    return mask


def _random_split(
    y: Tensor, padded: Tensor, num_classes: int, per_class: int, num_val: int, num_test: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """PyG's ``split="random"`` with a seeded generator and placeholder nodes excluded."""
    generator = torch.Generator().manual_seed(seed)
    num_nodes = y.numel()
    train = torch.zeros(num_nodes, dtype=torch.bool)
    for c in range(num_classes):
        idx = ((y == c) & ~padded).nonzero().view(-1)
        train[idx[torch.randperm(idx.numel(), generator=generator)[:per_class]]] = True
    remaining = (~train & ~padded).nonzero().view(-1)
    if num_val + num_test > remaining.numel():
        raise ValueError(
            f"num_val + num_test = {num_val + num_test} exceeds the {remaining.numel()} nodes "
            "left after picking the training nodes"
        )
    remaining = remaining[torch.randperm(remaining.numel(), generator=generator)]
    val = _index_to_mask(remaining[:num_val], num_nodes)
    test = _index_to_mask(remaining[num_val : num_val + num_test], num_nodes)
    return train, val, test
