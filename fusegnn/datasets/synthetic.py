r"""Reddit-like and OGB-like graphs, in memory or written in the real file layouts.

The machines that build and test fusegnn cannot download Reddit or the OGB sets. These
generators make graphs of the same size and shape, with a learnable signal, and write
them exactly as the real releases are laid out, so that the real loaders
(:func:`fusegnn.datasets.reddit.Reddit`, :func:`fusegnn.datasets.ogb.OGBNodeDataset`)
run on them unchanged:

* :func:`generate_reddit_like` / :func:`reddit_like`: ``<root>/Reddit/raw/reddit_data.npz``
  and ``reddit_graph.npz``;
* :func:`generate_ogbn_like` / :func:`ogbn_like`: ``<root>/ogbn_arxiv/`` or
  ``<root>/ogbn_products/`` in OGB's layout (``RELEASE_v1.txt``, ``raw/*.csv.gz``,
  ``split/<type>/{train,valid,test}.csv.gz``, an empty ``processed/``), which
  ``ogb.nodeproppred.NodePropPredDataset`` reads with no download.

The ``generate_*`` functions build the data set in memory (a
:class:`~fusegnn.datasets.NodeDataset`, equal to what the loader returns from the
written files), the others write it and return the directory written.

Model
-----
With ``N`` nodes, ``C`` classes and ``M`` undirected pairs to draw:

* **labels**: class ``c`` has probability :math:`\pi_c \propto e^{0.5 g_c}`,
  :math:`g_c \sim \mathcal N(0, 1)` (mildly imbalanced); every class gets at least one
  node;
* **degrees** (Chung-Lu): node ``i`` has weight :math:`w_i = e^{\sigma z_i}`,
  :math:`z_i \sim \mathcal N(0, 1)` (``degree_sigma`` :math:`= \sigma`), expected
  degree :math:`d_i = \min(2M w_i / \sum_j w_j, (N - 1) / 2)` and
  :math:`c_i = \max(1, \lfloor d_i + U_i \rfloor)` stubs, :math:`U_i \sim U[0, 1)`.
  A pair is drawn as :math:`u \sim c` (a uniform entry of the stub list); then with
  probability ``homophily`` :math:`v \sim c` restricted to the class of ``u``, else
  :math:`v \sim c` over all nodes. Either way :math:`P(v = i) = c_i / \sum_j c_j`, so
  degrees follow the lognormal weights: median :math:`e^{-\sigma^2 / 2}` times the
  mean. (The stub list is grouped by class, so every draw is one uniform index: no
  binary search, fast on CPU and GPU.);
* **edges**: self-loops are dropped and pairs deduplicated; pairs are drawn in rounds
  until at least ``M`` distinct ones exist, then a uniformly random ``M`` of them are
  kept, so the count is **exact**. A node ``i`` left isolated gets an edge by
  rewiring: a random (by stub count) node ``p`` of its class (rarely, of any class)
  trades one of its pairs
  ``(p, q)``, with ``deg(q) >= 2``, for ``(p, i)`` (so the count stays exact and no
  node becomes isolated). Undirected graphs are stored
  in both directions, sorted by source then target (coalesced). Deduplication bites
  where pairs are dense, i.e. among hubs and within classes: the realised tail and
  the edge homophily are somewhat below what the weights and ``homophily`` ask for,
  more so at small scales with the real degree (a class there has few nodes);
* **features**: :math:`x_i = \mu_{y_i} + \varepsilon_i` with
  :math:`\mu_c \sim \mathcal N(0, s^2 / (2F) I)` and
  :math:`\varepsilon_i \sim \mathcal N(0, I)`, float32, so two class centroids lie
  about ``class_sep`` :math:`= s` noise standard deviations apart in any width ``F``:
  features alone classify well above chance, and averaging over the (homophilous)
  neighbourhood, as a GCN does, much better;
* **splits**: a uniformly random partition with the real proportions (Reddit); by
  publication year (arxiv: train up to 2017, validation 2018, test 2019-2020, edges
  point from the newer paper to the older); random (products, whose real split is by
  sales rank).

Sizes
-----
At ``scale=s`` there are ``round(s * N_real)`` nodes and the real average degree, so
``M`` scales with ``s`` too:

========  ===========  ==============================  ========  =======  ==========================
name      nodes (s=1)  edges (s=1)                     features  classes  train / val / test (s=1)
========  ===========  ==============================  ========  =======  ==========================
Reddit    232,965      114,615,892 directed (= 2M)     602       41       153,431 / 23,831 / 55,703
arxiv     169,343      1,166,243 directed (= M)        128       40       90,941 / 29,799 / 48,603
products  2,449,029    61,859,140 pairs (= M; ogb      100       47       196,615 / 39,323 / 2,213,091
                       returns 123,718,280 directed)
========  ===========  ==============================  ========  =======  ==========================

Edge counts: Reddit ``2 * round(s * 114,615,892 / 2)``, arxiv ``round(s * 1,166,243)``,
products ``round(s * 61,859,140)`` raw pairs, all exact (Reddit's differs from
``round(s * 114,615,892)`` by at most one, as a symmetric graph without self-loops
has an even count). Split sizes are ``round(N * n_real / N_real)`` for validation and
test, the rest train. Keeping the average degree makes small scales dense (Reddit at
``s=0.01``: 2,330 nodes, 1.15M edges), so ``avg_degree`` overrides it: the
average number of directed edges per node in what the loader returns (with
``to_undirected=False`` for OGB), e.g. ``scale=0.005, avg_degree=20`` for a tiny test
graph. A pair count above a quarter of all possible pairs, or below the number of
nodes (mean undirected degree 2), is refused.

Generation uses torch ops only, on ``device``; results are deterministic for a given
``seed`` and device type (CPU and CUDA random streams differ).

Measured
--------
The full Reddit-like graph (seed 0, defaults): degrees min 1, 1% / 10% / 50% / 90% / 99%
quantiles 17 / 63 / 285 / 1131 / 3062, max 17,031 (real Reddit: max 21,657), edge
homophily 0.758, nearest-class-centroid accuracy of the features alone 0.60 (a
two-layer GCN reaches 0.98 on the small test graphs). On a 2-core CPU: about 70 s of
CPU time (100 s wall) with a 6.2 GB peak; ``scale=0.1`` 8 s, ``scale=0.01`` (real
degree, dense: several sampling rounds) 3 s, ``scale=0.005, avg_degree=20`` 0.25 s.
"""

from __future__ import annotations

import gzip
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fusegnn.datasets.base import NodeDataset
from fusegnn.sparse.graph import check_seed

__all__ = [
    "REDDIT_SPEC",
    "OGBN_SPECS",
    "GraphSpec",
    "generate_reddit_like",
    "reddit_like",
    "generate_ogbn_like",
    "ogbn_like",
]


@dataclass(frozen=True)
class GraphSpec:
    """Size of a real data set at scale 1.

    ``num_edges`` counts the rows of the raw edge list (Reddit: directed edges; arxiv:
    directed citations; products: undirected pairs, which ``ogb`` stores both ways).
    """

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    split: tuple[int, int, int]
    split_name: str = ""


REDDIT_SPEC = GraphSpec("Reddit", 232_965, 114_615_892, 602, 41, (153_431, 23_831, 55_703))
OGBN_SPECS = {
    "ogbn-arxiv": GraphSpec(
        "ogbn-arxiv", 169_343, 1_166_243, 128, 40, (90_941, 29_799, 48_603), "time"
    ),
    "ogbn-products": GraphSpec(
        "ogbn-products", 2_449_029, 61_859_140, 100, 47, (196_615, 39_323, 2_213_091), "sales_ranking"
    ),
}

_DEFAULT_HOMOPHILY = 0.8
_DEFAULT_SIGMA = 1.2
_DEFAULT_CLASS_SEP = 3.5
_MAX_DENSITY = 0.25  # refuse more than this fraction of all N (N - 1) / 2 pairs
_CHUNK = 1 << 23  # pairs drawn per batch (bounds the temporaries)
_RELEASE_MARK = "Synthetic"  # first word of RELEASE_v1.txt in generated OGB directories
_FEATURE_DECIMALS = 4  # OGB features are written as text; generated values are on this grid


# --------------------------------------------------------------------------- Reddit


def generate_reddit_like(
    scale: float = 1.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    avg_degree: float | None = None,
    homophily: float = _DEFAULT_HOMOPHILY,
    degree_sigma: float = _DEFAULT_SIGMA,
    class_sep: float = _DEFAULT_CLASS_SEP,
) -> NodeDataset:
    """A Reddit-shaped :class:`~fusegnn.datasets.NodeDataset`, built on ``device``.

    Args:
        scale: fraction of Reddit's 232,965 nodes (the edge count follows, see the
            module docstring).
        seed: seed of the ``torch.Generator`` everything is drawn from.
        device: where to build; ``"cuda"`` for the full graph (the work is a few
            sorts of ~10^8 int64 keys and random gathers).
        avg_degree: directed edges per node (Reddit's: about 492).
        homophily: probability that an edge's second endpoint is drawn within the
            first endpoint's class. The measured edge homophily is lower, as
            deduplication removes more of the denser within-class pairs: 0.76 at
            scale 1 with the default 0.8 (the real Reddit's is about 0.76), 0.5-0.7 at
            small scales.
        degree_sigma: lognormal sigma of the Chung-Lu weights (heavier tail if larger).
        class_sep: distance of class centroids in units of the feature noise.

    Returns:
        The data set as :func:`~fusegnn.datasets.reddit.Reddit` would load it: float32
        ``x`` ``[N, 602]``, int64 ``y``, a coalesced symmetric ``edge_index`` without
        self-loops or isolated nodes, and the masks; ``extra`` records the parameters.
    """
    device = torch.device(device)
    spec = REDDIT_SPEC
    n = _scaled_nodes(spec, scale)
    if avg_degree is None:
        num_pairs = int(round(spec.num_edges * scale / 2))
    else:
        num_pairs = int(round(n * _check_positive("avg_degree", avg_degree) / 2))
    gen = torch.Generator(device=device).manual_seed(check_seed(seed))
    y = _sample_labels(n, spec.num_classes, gen, device)
    a, b = _sample_pairs(n, num_pairs, y, spec.num_classes, homophily, degree_sigma, gen)
    edge_index = _mirror_sorted(a, b, n)
    x = _class_features(y, spec.num_features, spec.num_classes, class_sep, gen, decimals=None)
    node_types = _random_split(n, _split_sizes(n, spec), gen, device)
    return NodeDataset(
        name="Reddit",
        x=x,
        y=y,
        edge_index=edge_index,
        train_mask=node_types == 1,
        val_mask=node_types == 2,
        test_mask=node_types == 3,
        num_classes=spec.num_classes,
        extra={
            "synthetic": True,
            "node_types": node_types,
            "params": dict(
                scale=scale, seed=seed, avg_degree=avg_degree, homophily=homophily,
                degree_sigma=degree_sigma, class_sep=class_sep,
            ),
        },
    )


def reddit_like(
    root: str | os.PathLike,
    scale: float = 1.0,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    avg_degree: float | None = None,
    homophily: float = _DEFAULT_HOMOPHILY,
    degree_sigma: float = _DEFAULT_SIGMA,
    class_sep: float = _DEFAULT_CLASS_SEP,
    overwrite: bool = False,
) -> Path:
    """Write :func:`generate_reddit_like` (same arguments) as
    ``<root>/Reddit/raw/{reddit_data.npz, reddit_graph.npz}``; returns that directory.

    ``reddit_data.npz`` holds ``feature`` (float32), ``label`` and ``node_types``
    (int64, 1/2/3 = train/val/test) and a ``synthetic`` flag the loader ignores;
    ``reddit_graph.npz`` is what :func:`scipy.sparse.save_npz` writes for a
    ``coo_matrix`` (int32 ``row``/``col``, uint8 ones as ``data``, uncompressed),
    written without needing SciPy. Files written by this function are replaced; other
    files there (the real data set) only with ``overwrite=True``, else
    :class:`FileExistsError`.
    """
    directory = Path(root) / "Reddit" / "raw"
    data_file = directory / "reddit_data.npz"
    if data_file.exists() and not overwrite:
        with np.load(data_file) as existing:
            if "synthetic" not in existing.files:
                raise FileExistsError(f"{data_file} exists and was not written by reddit_like; pass overwrite=True")
    data = generate_reddit_like(
        scale, seed, device, avg_degree=avg_degree, homophily=homophily, degree_sigma=degree_sigma,
        class_sep=class_sep,
    )
    directory.mkdir(parents=True, exist_ok=True)
    n = data.num_nodes
    index_dtype = np.int32 if n < 2**31 else np.int64
    edge_index = data.edge_index.cpu().numpy()
    _atomic_savez(
        data_file,
        feature=data.x.cpu().numpy(),
        label=data.y.cpu().numpy(),
        node_types=data.extra["node_types"].cpu().numpy(),
        synthetic=np.array(True),
    )
    _atomic_savez(
        directory / "reddit_graph.npz",
        row=edge_index[0].astype(index_dtype),
        col=edge_index[1].astype(index_dtype),
        format=np.array(b"coo"),
        shape=np.array([n, n]),
        data=np.ones(edge_index.shape[1], dtype=np.uint8),
    )
    return directory


# --------------------------------------------------------------------------- OGB


@dataclass
class _OgbnRaw:
    """What the OGB files hold: features, labels, the raw edge rows, the split."""

    spec: GraphSpec
    x: Tensor  # [N, F] float32 on the 10^-4 grid
    y: Tensor  # [N] int64
    edges: Tensor  # [2, rows] int64 as in raw/edge.csv.gz
    split_idx: dict[str, Tensor]  # sorted int64 node ids
    node_year: Tensor | None  # [N] int64 (arxiv)
    params: dict


def _ogbn_raw(
    name: str,
    scale: float,
    seed: int,
    device: torch.device,
    avg_degree: float | None,
    homophily: float,
    degree_sigma: float,
    class_sep: float,
) -> _OgbnRaw:
    spec = OGBN_SPECS[_canonical_ogbn(name)]
    n = _scaled_nodes(spec, scale)
    directed = spec.name == "ogbn-arxiv"  # products: ogb adds the inverse edges
    if avg_degree is None:
        num_pairs = int(round(spec.num_edges * scale))
    else:
        _check_positive("avg_degree", avg_degree)
        num_pairs = int(round(n * avg_degree)) if directed else int(round(n * avg_degree / 2))
    gen = torch.Generator(device=device).manual_seed(check_seed(seed))
    y = _sample_labels(n, spec.num_classes, gen, device)
    a, b = _sample_pairs(n, num_pairs, y, spec.num_classes, homophily, degree_sigma, gen)
    x = _class_features(y, spec.num_features, spec.num_classes, class_sep, gen, decimals=_FEATURE_DECIMALS)
    node_types = _random_split(n, _split_sizes(n, spec), gen, device)
    split_idx = {
        key: torch.nonzero(node_types == code).squeeze(1) for key, code in (("train", 1), ("valid", 2), ("test", 3))
    }
    node_year = None
    if directed:
        # train: up to 2017 (skewed to recent years), valid: 2018, test: 2019-2020
        age = torch.empty(n, device=device).exponential_(0.25, generator=gen).floor().to(torch.int64)
        node_year = torch.where(node_types == 1, (2017 - age).clamp(min=1971), 2018)
        coin = torch.randint(0, 2, (n,), generator=gen, device=device)
        node_year = torch.where(node_types == 3, 2019 + coin, node_year)
        # a citation points from the newer paper to the older one (ties: random)
        ya, yb = node_year[a], node_year[b]
        tie_flip = torch.randint(0, 2, a.shape, generator=gen, device=device).bool()
        a_newer = (ya > yb) | ((ya == yb) & tie_flip)
        src, dst = torch.where(a_newer, a, b), torch.where(a_newer, b, a)
        order = torch.argsort(src * n + dst)
        edges = torch.stack([src[order], dst[order]])
    else:
        edges = torch.stack([a, b])
    params = dict(
        scale=scale, seed=seed, avg_degree=avg_degree, homophily=homophily,
        degree_sigma=degree_sigma, class_sep=class_sep,
    )
    return _OgbnRaw(spec, x, y, edges, split_idx, node_year, params)


def _ogb_returned_edges(raw: _OgbnRaw) -> Tensor:
    """The ``edge_index`` ``ogb`` builds from ``raw/edge.csv.gz`` (products: each row
    followed by its inverse, as ``read_csv_graph_raw(add_inverse_edge=True)`` does)."""
    if raw.spec.name == "ogbn-arxiv":
        return raw.edges
    src, dst = raw.edges
    return torch.stack([torch.stack([src, dst], 1).reshape(-1), torch.stack([dst, src], 1).reshape(-1)])


def generate_ogbn_like(
    name: str,
    scale: float = 1.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    to_undirected: bool = True,
    avg_degree: float | None = None,
    homophily: float = _DEFAULT_HOMOPHILY,
    degree_sigma: float = _DEFAULT_SIGMA,
    class_sep: float = _DEFAULT_CLASS_SEP,
) -> NodeDataset:
    """An ogbn-arxiv- or ogbn-products-shaped data set, built on ``device``.

    Args:
        name: ``"arxiv"`` / ``"ogbn-arxiv"`` or ``"products"`` / ``"ogbn-products"``.
        scale, seed, device, homophily, degree_sigma, class_sep: as in
            :func:`generate_reddit_like`.
        to_undirected: as in :func:`~fusegnn.datasets.ogb.OGBNodeDataset`: ``True``
            returns the coalesced symmetric graph, ``False`` the edges as ``ogb``
            returns them (arxiv: directed citations; products: both directions).
        avg_degree: directed edges per node in the graph ``ogb`` returns (arxiv about
            6.9, products about 50.5).

    Returns:
        What :func:`~fusegnn.datasets.ogb.OGBNodeDataset` returns for the files
        :func:`ogbn_like` writes, except that ``extra`` has no ``evaluator`` (so
        ``ogb`` is not needed here) and records the parameters.
    """
    from fusegnn.datasets.ogb import assemble_ogb_dataset

    device = torch.device(device)
    raw = _ogbn_raw(name, scale, seed, device, avg_degree, homophily, degree_sigma, class_sep)
    data = assemble_ogb_dataset(
        raw.spec.name, raw.x, raw.y, _ogb_returned_edges(raw), raw.split_idx, raw.spec.num_classes,
        to_undirected=to_undirected, node_year=raw.node_year,
    )
    data.extra.update(synthetic=True, params=raw.params)
    return data


def ogbn_like(
    root: str | os.PathLike,
    name: str,
    scale: float = 1.0,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    avg_degree: float | None = None,
    homophily: float = _DEFAULT_HOMOPHILY,
    degree_sigma: float = _DEFAULT_SIGMA,
    class_sep: float = _DEFAULT_CLASS_SEP,
    overwrite: bool = False,
) -> Path:
    """Write :func:`generate_ogbn_like` (same arguments) in OGB's layout; returns
    ``<root>/ogbn_arxiv`` or ``<root>/ogbn_products``.

    Files (all CSV without header, gzip): ``raw/edge.csv.gz`` (one ``src,dst`` row per
    raw edge), ``raw/node-feat.csv.gz`` (``%.4f``), ``raw/node-label.csv.gz``,
    ``raw/num-node-list.csv.gz``, ``raw/num-edge-list.csv.gz``, for arxiv
    ``raw/node_year.csv.gz``; ``split/<time|sales_ranking>/{train,valid,test}.csv.gz``;
    ``RELEASE_v1.txt`` and an empty ``processed/`` (where ``ogb`` caches its parse).
    A directory written by this function is replaced as a whole (with ``ogb``'s stale
    cache); any other (the real data set) only with ``overwrite=True``, else
    :class:`FileExistsError`. Text formatting makes the full products set take minutes.
    """
    canonical = _canonical_ogbn(name)
    directory = Path(root) / canonical.replace("-", "_")
    if directory.exists():
        release = directory / "RELEASE_v1.txt"
        ours = release.is_file() and release.read_text().startswith(_RELEASE_MARK)
        if not (ours or overwrite):
            raise FileExistsError(f"{directory} exists and was not written by ogbn_like; pass overwrite=True")
    raw = _ogbn_raw(canonical, scale, seed, torch.device(device), avg_degree, homophily, degree_sigma, class_sep)
    if directory.exists():
        shutil.rmtree(directory)
    raw_dir, split_dir = directory / "raw", directory / "split" / raw.spec.split_name
    for folder in (raw_dir, split_dir, directory / "processed"):
        folder.mkdir(parents=True, exist_ok=True)
    n = raw.x.size(0)
    _write_csv_gz(raw_dir / "edge.csv.gz", raw.edges.t().cpu().numpy(), "%d")
    _write_csv_gz(raw_dir / "node-feat.csv.gz", raw.x.cpu().numpy(), f"%.{_FEATURE_DECIMALS}f")
    _write_csv_gz(raw_dir / "node-label.csv.gz", raw.y.cpu().numpy()[:, None], "%d")
    _write_csv_gz(raw_dir / "num-node-list.csv.gz", np.array([[n]]), "%d")
    _write_csv_gz(raw_dir / "num-edge-list.csv.gz", np.array([[raw.edges.size(1)]]), "%d")
    if raw.node_year is not None:
        _write_csv_gz(raw_dir / "node_year.csv.gz", raw.node_year.cpu().numpy()[:, None], "%d")
    for key, idx in raw.split_idx.items():
        _write_csv_gz(split_dir / f"{key}.csv.gz", idx.cpu().numpy()[:, None], "%d")
    (directory / "RELEASE_v1.txt").write_text(
        f"{_RELEASE_MARK} {raw.spec.name}-like data written by fusegnn.datasets.synthetic.ogbn_like "
        f"({', '.join(f'{k}={v}' for k, v in raw.params.items())}); not the real data set.\n"
    )
    return directory


# --------------------------------------------------------------------------- building blocks


def _check_positive(arg: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{arg} must be a positive finite number, got {value!r}")
    return float(value)


def _canonical_ogbn(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.lower().replace("_", "-")
    key = key if key.startswith("ogbn-") else f"ogbn-{key}"
    if key not in OGBN_SPECS:
        raise ValueError(f"name must be one of {sorted(OGBN_SPECS)} (or 'arxiv' / 'products'), got {name!r}")
    return key


def _scaled_nodes(spec: GraphSpec, scale: float) -> int:
    _check_positive("scale", scale)
    n = int(round(spec.num_nodes * scale))
    if n < 2 * spec.num_classes:
        raise ValueError(
            f"scale={scale} gives {n} nodes; {spec.name} needs at least {2 * spec.num_classes} "
            f"(twice its {spec.num_classes} classes)"
        )
    return n


def _split_sizes(n: int, spec: GraphSpec) -> tuple[int, int, int]:
    """Train / validation / test sizes with the real proportions (exact at scale 1)."""
    val = int(round(n * spec.split[1] / spec.num_nodes))
    test = int(round(n * spec.split[2] / spec.num_nodes))
    return n - val - test, val, test


def _sample_labels(n: int, num_classes: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Mildly imbalanced labels; each class has at least one node."""
    logits = 0.5 * torch.randn(num_classes, generator=gen, device=device, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(logits, 0), n, replacement=True, generator=gen)
    first = torch.randperm(n, generator=gen, device=device)[:num_classes]
    y[first] = torch.arange(num_classes, device=device)
    return y


def _random_split(n: int, sizes: tuple[int, int, int], gen: torch.Generator, device: torch.device) -> Tensor:
    """``node_types``: 1 / 2 / 3 (train / val / test) on a random partition of the given sizes."""
    perm = torch.randperm(n, generator=gen, device=device)
    node_types = torch.full((n,), 3, dtype=torch.int64, device=device)
    node_types[perm[: sizes[0]]] = 1
    node_types[perm[sizes[0] : sizes[0] + sizes[1]]] = 2
    return node_types


def _class_features(
    y: Tensor, num_features: int, num_classes: int, class_sep: float, gen: torch.Generator, decimals: int | None
) -> Tensor:
    """``mu[y] + noise`` (float32); on the ``10**-decimals`` grid if ``decimals`` is given."""
    _check_positive("class_sep", class_sep)
    scale = class_sep / math.sqrt(2 * num_features)
    centroids = scale * torch.randn(num_classes, num_features, generator=gen, device=y.device)
    x = torch.randn(y.numel(), num_features, generator=gen, device=y.device)
    x += centroids[y]
    if decimals is not None:
        # k / 10^d with integer k: the float32 nearest to the decimal written as %.{d}f,
        # so the text files round-trip exactly.
        x = torch.round(x * 10**decimals) / 10**decimals
    return x


class _StubSampler:
    r"""Draws endpoints in proportion to stub counts: ``stubs`` lists node ``i``
    ``c_i`` times, grouped by class, so a node of the whole graph or of one class is a
    single uniform index into it (no binary search)."""

    def __init__(self, stubs: Tensor, y: Tensor, num_classes: int, homophily: float, gen: torch.Generator):
        self.n = y.numel()
        self.stubs, self.y, self.homophily, self.gen = stubs, y, homophily, gen
        self.count = torch.bincount(y[stubs], minlength=num_classes)
        self.start = torch.cumsum(self.count, 0) - self.count

    def _index(self, k: int, high: Tensor | int) -> Tensor:
        """Uniform integers in ``[0, high)`` (modulo bias below 2**-30)."""
        return torch.randint(0, 1 << 62, (k,), generator=self.gen, device=self.stubs.device) % high

    def global_nodes(self, k: int) -> Tensor:
        return self.stubs[self._index(k, self.stubs.numel())]

    def class_nodes(self, classes: Tensor) -> Tensor:
        """One node per entry of ``classes``, by stub count within that class (classes
        without stubs fall back to the whole graph)."""
        count = self.count[classes]
        nodes = self.stubs[self.start[classes] + self._index(classes.numel(), count.clamp(min=1))]
        empty = count == 0
        if bool(empty.any()):
            nodes[empty] = self.global_nodes(int(empty.sum()))
        return nodes

    def keys(self, k: int) -> Tensor:
        """``min(u, v) * n + max(u, v)`` of ``k`` drawn pairs, self-loops dropped."""
        u = self.global_nodes(k)
        v = self.global_nodes(k)
        same = torch.rand(k, generator=self.gen, device=u.device) < self.homophily
        v[same] = self.class_nodes(self.y[u[same]])
        keep = u != v
        u, v = u[keep], v[keep]
        return torch.minimum(u, v) * self.n + torch.maximum(u, v)


def _sample_pairs(
    n: int,
    num_pairs: int,
    y: Tensor,
    num_classes: int,
    homophily: float,
    degree_sigma: float,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Exactly ``num_pairs`` distinct pairs ``a < b``, sorted, every node in one.

    See the module docstring for the model; the expected degrees
    :math:`d_i = 2M w_i / \\bar w` become stub counts :math:`\\max(1, \\lfloor d_i + U_i \\rfloor)`.
    """
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"homophily must be in [0, 1], got {homophily!r}")
    _check_positive("degree_sigma", degree_sigma)
    max_pairs = n * (n - 1) // 2
    if num_pairs > _MAX_DENSITY * max_pairs:
        raise ValueError(
            f"{num_pairs} pairs on {n} nodes is more than {_MAX_DENSITY:.0%} of all {max_pairs} pairs; "
            f"lower avg_degree or raise scale"
        )
    if num_pairs < n:
        raise ValueError(
            f"{num_pairs} pairs on {n} nodes: at least one per node (undirected degree 2) is needed "
            f"to leave no node isolated; raise avg_degree"
        )
    device = y.device
    w = torch.exp(degree_sigma * torch.randn(n, generator=gen, device=device, dtype=torch.float64))
    expected = (w * (2 * num_pairs / float(w.sum()))).clamp(max=0.5 * (n - 1))
    uniform = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    stub_count = (expected + uniform).floor().to(torch.int64).clamp(min=1)
    order = torch.argsort(y, stable=True)
    stubs = torch.repeat_interleave(order, stub_count[order])
    sampler = _StubSampler(stubs, y, num_classes, homophily, gen)

    keys = torch.empty(0, dtype=torch.int64, device=device)
    draw = int(num_pairs * 1.2) + 1024
    while True:
        parts = [keys] + [sampler.keys(min(_CHUNK, draw - s)) for s in range(0, draw, _CHUNK)]
        merged = torch.unique(torch.cat(parts), sorted=True)
        gained, keys = merged.numel() - keys.numel(), merged
        del parts, merged
        if keys.numel() >= num_pairs:
            break
        rate = gained / draw  # fraction of draws that were new pairs
        if rate < 1e-3:
            raise ValueError(
                f"could not draw {num_pairs} distinct pairs on {n} nodes (got {keys.numel()}): the "
                f"classes are too small for homophily={homophily} at this degree; lower homophily or avg_degree"
            )
        draw = min(int((num_pairs - keys.numel()) / rate * 1.5) + 1024, 4 * num_pairs + 1024)
    if keys.numel() > num_pairs:  # keep a uniformly random num_pairs of them
        keep = torch.randperm(keys.numel(), generator=gen, device=device)[:num_pairs]
        keys = keys[torch.sort(keep).values]
    a = torch.div(keys, n, rounding_mode="floor")
    b = keys - a * n
    del sampler, keys
    return _connect_isolated(a, b, n, stubs, y, num_classes, gen)


def _connect_isolated(
    a: Tensor, b: Tensor, n: int, stubs: Tensor, y: Tensor, num_classes: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Give every isolated node ``i`` one edge by rewiring, keeping the pair count.

    ``i`` gets a random (by stub count) non-isolated partner ``p`` of its class, and a
    random pair ``(p, q)`` of ``p`` with ``deg(q) >= 2`` becomes ``(p, i)``: ``p`` keeps
    its degree, ``q`` loses one edge (each ``q`` and each pair at most once per round),
    so no node becomes isolated and no pair repeats (``i`` had none). Rounds repeat
    for the isolated nodes whose draw was unusable (after 8 rounds with partners of any
    class). Returns sorted pairs ``a < b``.
    """
    device = a.device
    pair_ids = torch.arange(a.numel(), device=device)
    for attempt in range(64):
        degree = torch.bincount(a, minlength=n) + torch.bincount(b, minlength=n)
        isolated = torch.nonzero(degree == 0).squeeze(1)
        if isolated.numel() == 0:
            keys = torch.sort(torch.minimum(a, b) * n + torch.maximum(a, b)).values
            a = torch.div(keys, n, rounding_mode="floor")
            return a, keys - a * n
        isolated = isolated[torch.randperm(isolated.numel(), generator=gen, device=device)]
        connected = stubs[degree[stubs] > 0]  # still grouped by class
        sampler = _StubSampler(connected, y, num_classes, 0.0, gen)
        if attempt < 8:
            partner = sampler.class_nodes(y[isolated])
        else:  # a tiny class may have no usable pair: any class then
            partner = sampler.global_nodes(isolated.numel())
        # the pairs incident to each partner, grouped by partner (CSR over both endpoints)
        is_partner = torch.zeros(n, dtype=torch.bool, device=device)
        is_partner[partner] = True
        touching = pair_ids[is_partner[a] | is_partner[b]]
        ends, ids = torch.cat([a[touching], b[touching]]), torch.cat([touching, touching])
        ends, ids = ends[is_partner[ends]], ids[is_partner[ends]]
        ids = ids[torch.argsort(ends, stable=True)]
        ptr = torch.cumsum(degree * is_partner, 0) - degree * is_partner
        pick = torch.randint(0, 1 << 62, (isolated.numel(),), generator=gen, device=device) % degree[partner]
        pair = ids[ptr[partner] + pick]
        other = a[pair] + b[pair] - partner
        usable = degree[other] >= 2
        for key in (pair, other):  # first use of each pair and each losing node only
            position = torch.arange(key.numel(), device=device)
            first = torch.full((n if key is other else a.numel(),), key.numel(), device=device)
            first = first.scatter_reduce(0, key[usable], position[usable], "amin")
            usable &= first[key] == position
        a[pair[usable]], b[pair[usable]] = partner[usable], isolated[usable]
    still = int((torch.bincount(a, minlength=n) + torch.bincount(b, minlength=n) == 0).sum())
    raise RuntimeError(f"{still} nodes stay isolated; raise avg_degree")


def _mirror_sorted(a: Tensor, b: Tensor, n: int) -> Tensor:
    """``[[a, b], [b, a]]`` sorted by source, then target (coalesced; no duplicates as
    the pairs ``a < b`` are distinct)."""
    keys = torch.sort(torch.cat([a * n + b, b * n + a])).values
    row = torch.div(keys, n, rounding_mode="floor")
    return torch.stack([row, keys - row * n])


def _atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.part")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_csv_gz(path: Path, array: np.ndarray, fmt: str) -> None:
    """``array`` (2-D) as headerless comma-separated text, gzip level 1, in row blocks."""
    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {array.shape}")
    row_fmt = ",".join([fmt] * array.shape[1]) + "\n"
    tmp = path.with_name(f".{path.name}.part")
    try:
        with gzip.open(tmp, "wb", compresslevel=1) as out:
            block = max(1, (1 << 20) // max(1, array.shape[1]))
            for start in range(0, array.shape[0], block):
                chunk = array[start : start + block]
                out.write((row_fmt * chunk.shape[0] % tuple(chunk.ravel())).encode("ascii"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
