r"""ogbn-arxiv and ogbn-products through ``ogb`` (the optional extra ``ogb``: ``./install.sh ogb``).

From the Open Graph Benchmark (Hu et al., NeurIPS 2020). The files are read by ``ogb``'s
own :class:`ogb.nodeproppred.NodePropPredDataset` and scored with its
:class:`ogb.nodeproppred.Evaluator`; this module turns the result into a
:class:`~fusegnn.datasets.NodeDataset`:

=============  =========  =====================================  ========  =======  ==========================
name           nodes      edges (``to_undirected=False / True``)  features  classes  train / valid / test
=============  =========  =====================================  ========  =======  ==========================
ogbn-arxiv     169,343    1,166,243 / 2,315,598                  128       40       90,941 / 29,799 / 48,603
ogbn-products  2,449,029  123,718,280 / 123,718,280              100       47       196,615 / 39,323 / 2,213,091
=============  =========  =====================================  ========  =======  ==========================

* arxiv is a directed citation graph (``edge.csv.gz`` rows ``citing, cited``), returned
  as ``ogb`` gives it with ``to_undirected=False``; products' raw file holds each of its
  61,859,140 undirected pairs once and ``ogb`` returns both directions.
* ``to_undirected=True`` (the default, what GCN / GAT training uses, as PyG's
  ``ToUndirected`` does) adds the reverse of every edge and coalesces: sorted by source,
  then target, duplicates merged (self-loops are kept).
* ``y`` is ``labels[:, 0]`` (int64); the masks come from ``get_idx_split()`` (arxiv:
  by year, products: by sales rank).
* ``extra``: ``evaluator`` (the ``ogb`` :class:`~ogb.nodeproppred.Evaluator`; call
  ``evaluator.eval({"y_true": y[mask, None], "y_pred": pred[mask, None]})["acc"]``),
  ``split_idx`` (``{"train", "valid", "test"}`` int64 node ids), ``node_year`` (arxiv),
  ``ogb_num_edges`` (the edge count ``ogb`` returned) and ``root``.

Layout and download
-------------------
OGB's layout, ``<base>/ogbn_arxiv/`` (``ogbn_products/``): ``RELEASE_v1.txt``,
``raw/edge.csv.gz``, ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz``,
``raw/num-{node,edge}-list.csv.gz`` (arxiv also ``raw/node_year.csv.gz``),
``split/<time|sales_ranking>/{train,valid,test}.csv.gz`` and ``processed/``, where
``ogb`` caches its parse (``processed/data_processed``; later loads read only that).
``<base>`` is searched as for every loader (:mod:`fusegnn.datasets.paths`; ``root`` may
also name the ``ogbn_arxiv/`` folder itself); with ``download=True`` a missing data set
is fetched from OGB's URL and unpacked into ``root`` if given, else into the cache (no
interactive prompt, unlike ``ogb``'s own download for files over 1 GB); offline, a
:class:`FileNotFoundError` lists what to put where.
:func:`fusegnn.datasets.synthetic.ogbn_like` writes generated data in this layout.

The parse cache is written only where fusegnn may write: the data set's own
``processed/`` when it is writable and not inside ``$FUSEGNN_DATA``, else
``<cache>/ogb-processed/<folder>-<stamp>/data_processed`` (the stamp hashes the folder's
path and its raw files' sizes and times). A read-only copy is only ever read.

The ``torch.load`` of ``ogb`` 1.3.6
-----------------------------------
``ogb`` 1.3.6 reloads its cache with a bare ``torch.load(path)``. Since torch 2.6 that
defaults to ``weights_only=True``, which refuses the NumPy arrays in the cache, so the
second load of any data set fails. The loader uses a subclass of
``NodePropPredDataset`` whose ``pre_process`` reads the cache itself with
``weights_only=False`` (the file was written from the raw CSVs on this machine; do not
point ``root`` at caches you do not trust), or parses the raw CSVs with ``ogb``'s own
reader and writes the cache where it may (above). Nothing global is patched:
``torch.load``, ``ogb``'s modules and any ``NodePropPredDataset`` created elsewhere
behave as before.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fusegnn.datasets import paths
from fusegnn.datasets.base import NodeDataset
from fusegnn.datasets.reddit import coalesce_edge_index

__all__ = ["OGBNodeDataset", "OGB_NODE_DATASETS", "assemble_ogb_dataset", "make_undirected"]

#: The node-property data sets this loader supports.
OGB_NODE_DATASETS = ("ogbn-arxiv", "ogbn-products")


def OGBNodeDataset(  # noqa: N802 (named like ogb's classes)
    name: str,
    root: str | os.PathLike | None = None,
    *,
    to_undirected: bool = True,
    download: bool = True,
) -> NodeDataset:
    """Load ``ogbn-arxiv`` or ``ogbn-products`` with ``ogb`` as a :class:`~fusegnn.datasets.NodeDataset`.

    Args:
        name: ``"ogbn-arxiv"`` or ``"ogbn-products"`` (``"arxiv"``, ``"ogbn_arxiv"``, ...
            are accepted).
        root: base directory holding ``ogbn_arxiv/`` (``ogbn_products/``), or that
            folder itself; it must exist. ``None`` searches ``$FUSEGNN_DATA`` and the
            cache.
        to_undirected: symmetrise and coalesce the edges (see the module docstring).
        download: fetch and unpack OGB's zip into ``root`` (else the cache) when no
            searched directory has the data set.

    Raises:
        ImportError: ``ogb`` is not installed.
        ValueError: unknown ``name``.
        FileNotFoundError: the files are missing and could not be downloaded, or
            ``root`` does not exist.
    """
    name = _canonical_name(name)
    ogbn = _import_ogb()
    meta = _meta(name)
    directory = _find_dir(name, meta, root, download)
    dataset = _dataset_class()(name=name, meta_dict=dict(meta, dir_path=str(directory)))
    graph, labels = dataset[0]
    split = dataset.get_idx_split()
    x = torch.from_numpy(np.ascontiguousarray(graph["node_feat"], dtype=np.float32))
    y = torch.from_numpy(np.asarray(labels).reshape(-1).astype(np.int64))
    edge_index = torch.from_numpy(np.asarray(graph["edge_index"]).astype(np.int64, copy=False))
    split_idx = {k: torch.from_numpy(np.asarray(v).astype(np.int64)).reshape(-1) for k, v in split.items()}
    node_year = graph.get("node_year")
    if node_year is not None:
        node_year = torch.from_numpy(np.asarray(node_year).reshape(-1).astype(np.int64))
    data = assemble_ogb_dataset(
        name, x, y, edge_index, split_idx, int(dataset.num_classes),
        to_undirected=to_undirected, node_year=node_year,
    )
    data.extra.update(evaluator=ogbn.Evaluator(name=name), root=str(directory))
    return data


def assemble_ogb_dataset(
    name: str,
    x: Tensor,
    y: Tensor,
    edge_index: Tensor,
    split_idx: dict[str, Tensor],
    num_classes: int,
    *,
    to_undirected: bool = True,
    node_year: Tensor | None = None,
) -> NodeDataset:
    """The :class:`~fusegnn.datasets.NodeDataset` for what ``ogb`` returned
    (shared with :func:`fusegnn.datasets.synthetic.generate_ogbn_like`)."""
    n = x.size(0)
    if y.shape != (n,):
        raise ValueError(f"{name}: expected {n} labels, got shape {tuple(y.shape)}")
    masks = {}
    for key in ("train", "valid", "test"):
        mask = torch.zeros(n, dtype=torch.bool, device=x.device)
        mask[split_idx[key].to(x.device)] = True
        masks[key] = mask
    extra: dict[str, Any] = {
        "split_idx": {k: v for k, v in split_idx.items()},
        "ogb_num_edges": int(edge_index.size(1)),
    }
    if node_year is not None:
        extra["node_year"] = node_year
    return NodeDataset(
        name=name,
        x=x,
        y=y,
        edge_index=make_undirected(edge_index, n) if to_undirected else edge_index,
        train_mask=masks["train"],
        val_mask=masks["valid"],
        test_mask=masks["test"],
        num_classes=num_classes,
        extra=extra,
    )


def make_undirected(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` plus every reversed edge, coalesced (sorted by source, then
    target; duplicates merged; self-loops kept)."""
    both = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    return coalesce_edge_index(both, num_nodes)


# --------------------------------------------------------------------------- helpers


def _canonical_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.lower().replace("_", "-")
    key = key if key.startswith("ogbn-") else f"ogbn-{key}"
    if key not in OGB_NODE_DATASETS:
        raise ValueError(f"name must be one of {', '.join(OGB_NODE_DATASETS)}, got {name!r}")
    return key


def _import_ogb():
    try:
        import ogb.nodeproppred as ogbn
    except ImportError as err:
        raise ImportError(
            "the OGB data sets need the 'ogb' package: ./install.sh ogb, or pip install -e '.[ogb]' "
            "in a fusegnn checkout (or pip install ogb)"
        ) from err
    return ogbn


def _meta(name: str) -> dict[str, str]:
    """``ogb``'s ``master.csv`` entry for ``name`` (version, url, split, ...)."""
    import pandas as pd  # an ogb dependency
    import ogb.nodeproppred

    master = pd.read_csv(
        os.path.join(os.path.dirname(ogb.nodeproppred.__file__), "master.csv"), index_col=0, keep_default_na=False
    )
    return {str(k): str(v) for k, v in master[name].items()}


def _required_files(meta: dict[str, str], cache: bool) -> list[str]:
    split = f"split/{meta['split']}"
    data = ["processed/data_processed"] if cache else ["raw/edge.csv.gz", "raw/num-node-list.csv.gz"]
    return [f"RELEASE_v{meta['version']}.txt", *data, f"{split}/train.csv.gz", f"{split}/valid.csv.gz",
            f"{split}/test.csv.gz"]


def _find_dir(name: str, meta: dict[str, str], root: str | os.PathLike | None, download: bool) -> Path:
    """``<base>/ogbn_<name>`` with the raw files (or ``ogb``'s cache) and the split."""
    dir_name = name.replace("-", "_")
    for cache in (False, True):
        directory = paths.locate_dataset_dir(dir_name, _required_files(meta, cache), root, subdir="")
        if directory is not None:
            return directory
    return paths.find_dataset_dir(
        dir_name, _required_files(meta, cache=False), root, subdir="",
        fetch=functools.partial(_download, meta) if download else None, source=meta["url"],
        how_to_get=lambda missing: f"download {meta['url']} and unzip it; its folder "
                                   f"{meta['download_name']}/ becomes {dir_name}/",
    )


def _download(meta: dict[str, str], target: Path) -> None:
    """Fetch OGB's zip and unpack its top folder as ``target`` (which is created, or
    filled in if incomplete, only once the archive is unpacked)."""
    with paths.staging_dir(target) as tmp:
        archive = tmp / meta["url"].rsplit("/", 1)[-1]
        paths.fetch_url(meta["url"], archive)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp / "unpacked")
        unpacked = tmp / "unpacked" / meta["download_name"]
        if not unpacked.is_dir():
            raise OSError(f"{meta['url']} has no top folder {meta['download_name']!r}")
        if target.exists():  # an incomplete copy: fill it in
            shutil.copytree(unpacked, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(unpacked, target)


def _processed_file(directory: Path) -> Path:
    """Where ``ogb``'s parse of ``directory`` is cached: its own ``processed/`` when that
    may be written, else a folder of the cache named after ``directory`` and its raw
    files' sizes and times (so an edited copy does not read a stale parse)."""
    own = directory / "processed" / "data_processed"
    if own.is_file() or paths.is_writable(own):
        return own
    stamp = hashlib.sha256(str(directory.resolve()).encode())
    for file in sorted((directory / "raw").glob("*")):
        info = file.stat()
        stamp.update(f"{file.name}:{info.st_size}:{info.st_mtime_ns}".encode())
    return paths.cache_dir() / "ogb-processed" / f"{directory.name}-{stamp.hexdigest()[:16]}" / "data_processed"


def _parse_raw(directory: Path, meta: dict[str, str]) -> tuple[dict, np.ndarray]:
    """``ogb``'s parse of the raw CSV files (what its ``pre_process`` does before saving)."""
    import pandas as pd  # an ogb dependency
    from ogb.io.read_graph_raw import read_csv_graph_raw

    def files(key: str) -> list[str]:
        return [] if meta[key] == "None" else meta[key].split(",")

    raw = directory / "raw"
    graph = read_csv_graph_raw(
        str(raw), add_inverse_edge=meta["add_inverse_edge"] == "True",
        additional_node_files=files("additional node files"), additional_edge_files=files("additional edge files"),
    )[0]
    labels = pd.read_csv(raw / "node-label.csv.gz", compression="gzip", header=None).values
    return graph, labels


@functools.lru_cache(maxsize=None)
def _dataset_class():
    """``NodePropPredDataset`` with a ``torch.load`` of its cache that works on torch >= 2.6."""
    from ogb.nodeproppred import NodePropPredDataset

    class _NodePropPredDataset(NodePropPredDataset):
        def pre_process(self):
            path = _processed_file(Path(self.root))
            if path.is_file():
                loaded = torch.load(path, weights_only=False)  # ogb's own cache (see module docstring)
                self.graph, self.labels = loaded["graph"], loaded["labels"]
                return
            self.graph, self.labels = _parse_raw(Path(self.root), self.meta_info)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
            try:
                torch.save({"graph": self.graph, "labels": self.labels}, tmp, pickle_protocol=4)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)

        def get_idx_split(self, split_type=None):
            path = os.path.join(self.root, "split", split_type or self.meta_info["split"], "split_dict.pt")
            if os.path.isfile(path):
                return torch.load(path, weights_only=False)
            return super().get_idx_split(split_type)

    _NodePropPredDataset.__name__ = _NodePropPredDataset.__qualname__ = "NodePropPredDataset"
    return _NodePropPredDataset
