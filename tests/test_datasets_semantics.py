""":mod:`fusegnn.datasets` as a user meets it.

* The synthetic generators are deterministic for a seed, differ across seeds, honour
  ``scale`` and ``avg_degree``, and refuse a seed they would otherwise change (a float or
  a bool: ``int()`` made 1.5 the graph of seed 1) or cannot take, naming ``seed``.
* Without the data (and without network) the Reddit and OGB loaders end in one
  ``FileNotFoundError`` naming the folders searched and ``FUSEGNN_DATA``, and write
  nothing into a read-only root, ``$FUSEGNN_DATA`` or the cache.
* Loading Planetoid from a read-only ``$FUSEGNN_DATA`` leaves it untouched.
* ``load_dataset`` refuses a name that is not a str with an error naming ``name``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from fusegnn.datasets import OGBNodeDataset, Planetoid, Reddit, generate_ogbn_like, generate_reddit_like
from fusegnn.datasets import paths

FIELDS = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")


def _equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def _make(kind, **kwargs):
    if kind == "reddit":
        return generate_reddit_like(0.001, avg_degree=10, **kwargs)
    return generate_ogbn_like(kind, 0.002 if kind == "arxiv" else 0.0002, avg_degree=8, **kwargs)


@pytest.mark.parametrize("kind", ["reddit", "arxiv", "products"])
def test_generator_is_a_function_of_its_seed(kind):
    first, again, other = _make(kind, seed=3), _make(kind, seed=3), _make(kind, seed=4)
    assert _equal(first, again)
    assert not _equal(first, other)
    assert _equal(_make(kind, seed=np.int64(3)), first)  # NumPy ints are ints


# (nodes = round(scale * real nodes), classes, directed edges = avg_degree * nodes as the
# loader returns them: Reddit and products both ways, arxiv its directed citations)
SIZES = {"reddit": (233, 41, 2 * round(233 * 10 / 2)), "arxiv": (339, 40, 339 * 8),
         "products": (490, 47, 2 * round(490 * 8 / 2))}


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_generator_honours_scale_and_avg_degree(kind):
    data = _make(kind, seed=0, **({} if kind == "reddit" else {"to_undirected": False}))
    assert (data.num_nodes, data.num_classes, data.num_edges) == SIZES[kind]
    ei = data.edge_index
    assert not bool((ei[0] == ei[1]).any()), "self-loops"
    assert ei.unique(dim=1).size(1) == ei.size(1), "duplicate edges"
    split = data.train_mask.long() + data.val_mask.long() + data.test_mask.long()
    assert bool((split == 1).all()), "the masks must partition the nodes"


@pytest.mark.parametrize(
    "seed,error",
    [(1.5, TypeError), (True, TypeError), ("3", TypeError), (2**64, ValueError), (-(2**63) - 1, ValueError)],
)
@pytest.mark.parametrize("kind", ["reddit", "arxiv"])
def test_generator_refuses_a_seed_it_would_change(kind, seed, error):
    """1.5 was the graph of seed 1 (and ``extra["params"]`` said 1.5); True that of 1;
    2**64 failed in the generator with "Overflow when unpacking long long"."""
    with pytest.raises(error, match="seed"):
        _make(kind, seed=seed)


@pytest.mark.parametrize("name", [None, 3, Path("Cora")])
def test_load_dataset_refuses_a_name_that_is_not_a_str_naming_it(name):
    """``load_dataset(None)`` ended in "'NoneType' object has no attribute 'lower'"."""
    from fusegnn.datasets import load_dataset

    with pytest.raises(TypeError, match="name must be a str"):
        load_dataset(name)


# ----------------------------------------------------------------------------- no data


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    """An empty ``$FUSEGNN_DATA``, an empty cache, a read-only root and no network."""
    env, cache, root = tmp_path / "env", tmp_path / "cache", tmp_path / "root"
    for folder in (env, cache, root):
        folder.mkdir()
    monkeypatch.setenv(paths.ENV_VAR, str(env))
    monkeypatch.setattr(paths, "cache_dir", lambda: cache)

    def offline(url, *args, **kwargs):
        raise OSError(f"no network here ({url})")

    monkeypatch.setattr(paths, "fetch_url", offline)
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    yield root, env, cache
    root.chmod(stat.S_IRWXU)


LOADERS = {
    "Reddit": lambda root: Reddit(root),
    "Reddit (no root)": lambda root: Reddit(None),
    "ogbn-arxiv": lambda root: OGBNodeDataset("ogbn-arxiv", root),
    "ogbn-products (no root)": lambda root: OGBNodeDataset("ogbn-products", None),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loader_without_data_names_where_and_writes_nothing(no_data, loader):
    root, env, cache = no_data
    if loader.startswith("ogbn"):  # the file list comes from ogb's own master.csv: without ogb, its ImportError
        pytest.importorskip("ogb")
    with pytest.raises(FileNotFoundError) as info:
        LOADERS[loader](root)
    message = str(info.value)
    assert paths.ENV_VAR in message and str(env) in message
    if "no root" not in loader:
        assert str(root) in message
    for folder in (root, env, cache):
        assert _files(folder) == [], f"{folder} was written: {_files(folder)}"


def test_planetoid_leaves_a_read_only_fusegnn_data_untouched(monkeypatch):
    data_root = Path(os.environ.get(paths.ENV_VAR, "/work/shared/data/planetoid"))
    if not (data_root / "Cora" / "raw").is_dir():
        pytest.skip(f"no Cora raw files under {data_root}")
    monkeypatch.setenv(paths.ENV_VAR, str(data_root))
    before = {p: p.stat().st_mtime_ns for p in data_root.rglob("*")}
    data = Planetoid(None, "Cora", download=False)
    assert (data.num_nodes, data.num_edges) == (2708, 10556)
    assert {p: p.stat().st_mtime_ns for p in data_root.rglob("*")} == before
