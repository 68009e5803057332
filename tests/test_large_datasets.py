"""Reddit and OGB loaders, round-tripped through the generators of
:mod:`fusegnn.datasets.synthetic` at small scales (no network: downloads are either
disabled or pointed at local ``file://`` archives)."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fusegnn.datasets import NodeDataset
from fusegnn.datasets import reddit as reddit_module
from fusegnn.datasets.reddit import Reddit, coalesce_edge_index
from fusegnn.datasets.synthetic import (
    OGBN_SPECS,
    REDDIT_SPEC,
    generate_ogbn_like,
    generate_reddit_like,
    ogbn_like,
    reddit_like,
)

REDDIT_SCALE, REDDIT_DEGREE = 0.005, 20  # 1165 nodes, 23,300 directed edges
ARXIV_SCALE = 0.01  # 1693 nodes, 11,662 citations (the real average degree)
PRODUCTS_SCALE, PRODUCTS_DEGREE = 0.002, 12  # 4898 nodes, 29,388 directed edges


@pytest.fixture(autouse=True)
def _isolated_data_roots(monkeypatch, tmp_path):
    """No test sees the user's $FUSEGNN_DATA or cache."""
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def reddit_small() -> NodeDataset:
    return generate_reddit_like(REDDIT_SCALE, seed=0, avg_degree=REDDIT_DEGREE)


@pytest.fixture(scope="module")
def reddit_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reddit")
    written = reddit_like(root, REDDIT_SCALE, seed=0, avg_degree=REDDIT_DEGREE)
    assert written == root / "Reddit" / "raw"
    return root


def assert_same_dataset(a: NodeDataset, b: NodeDataset) -> None:
    assert a.name == b.name and a.num_classes == b.num_classes
    for field in ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), field


def split_sizes(data: NodeDataset) -> tuple[int, int, int]:
    return int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum())


def degrees(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(edge_index[0], minlength=n)


def check_simple_symmetric(edge_index: torch.Tensor, n: int) -> None:
    """Symmetric, coalesced (sorted, no duplicates), no self-loops, no isolated nodes."""
    assert edge_index.dtype == torch.int64 and edge_index.dim() == 2 and edge_index.size(0) == 2
    row, col = edge_index
    key = row * n + col
    assert bool((key[1:] > key[:-1]).all()), "not sorted / has duplicates"
    assert not bool((row == col).any()), "self-loop"
    assert torch.equal(torch.sort(col * n + row).values, key), "not symmetric"
    assert int(degrees(edge_index, n).min()) >= 1, "isolated node"


def edge_homophily(data: NodeDataset) -> float:
    return (data.y[data.edge_index[0]] == data.y[data.edge_index[1]]).double().mean().item()


def nearest_centroid_accuracy(x: torch.Tensor, data: NodeDataset, fit: torch.Tensor, score: torch.Tensor) -> float:
    c = data.num_classes
    counts = torch.bincount(data.y[fit], minlength=c).clamp(min=1)
    centroids = torch.zeros(c, x.size(1)).index_add_(0, data.y[fit], x[fit]) / counts[:, None]
    pred = torch.cdist(x[score], centroids).argmin(1)
    return (pred == data.y[score]).double().mean().item()


# --------------------------------------------------------------------------- Reddit


def test_reddit_roundtrip_equals_in_memory(reddit_root, reddit_small):
    loaded = Reddit(reddit_root, download=False)
    assert_same_dataset(loaded, reddit_small)
    assert loaded.x.dtype == torch.float32 and loaded.y.dtype == torch.int64
    assert loaded.train_mask.dtype == torch.bool


def test_reddit_like_statistics(reddit_root):
    data = Reddit(reddit_root, download=False)
    n = round(REDDIT_SPEC.num_nodes * REDDIT_SCALE)
    assert data.num_nodes == n == 1165
    assert data.num_edges == 2 * round(n * REDDIT_DEGREE / 2) == 23300
    assert data.num_features == 602 and data.num_classes == 41
    assert torch.equal(torch.unique(data.y), torch.arange(41))
    val, test = round(n * 23_831 / 232_965), round(n * 55_703 / 232_965)
    assert split_sizes(data) == (n - val - test, val, test)
    cover = data.train_mask.long() + data.val_mask.long() + data.test_mask.long()
    assert bool((cover == 1).all())
    check_simple_symmetric(data.edge_index, n)
    deg = degrees(data.edge_index, n).double()
    assert deg.max() >= 5 * deg.median(), "degree distribution is not heavy-tailed"
    assert edge_homophily(data) > 0.4 > 10 / 41
    # features are class-informative, and averaging over neighbours (as a GCN does) more so
    plain = nearest_centroid_accuracy(data.x, data, data.train_mask, data.train_mask)
    assert plain > 0.3 > 10 / 41
    mean_nbr = torch.zeros_like(data.x).index_add_(0, data.edge_index[1], data.x[data.edge_index[0]])
    mean_nbr /= deg[:, None].float()
    smoothed = nearest_centroid_accuracy(mean_nbr, data, data.train_mask, data.test_mask)
    assert smoothed > 0.6


def test_reddit_like_matches_scipy(reddit_root, reddit_small):
    sp = pytest.importorskip("scipy.sparse")
    adj = sp.load_npz(reddit_root / "Reddit" / "raw" / "reddit_graph.npz")
    assert adj.format == "coo" and adj.shape == (reddit_small.num_nodes,) * 2
    assert adj.nnz == reddit_small.num_edges and (adj != adj.T).nnz == 0
    with np.load(reddit_root / "Reddit" / "raw" / "reddit_data.npz") as raw:
        assert raw["feature"].dtype == np.float32 and raw["feature"].shape == (1165, 602)
        assert set(np.unique(raw["node_types"])) == {1, 2, 3}


def test_generator_is_deterministic():
    a = generate_reddit_like(0.002, seed=3, avg_degree=12)
    assert_same_dataset(a, generate_reddit_like(0.002, seed=3, avg_degree=12))
    b = generate_reddit_like(0.002, seed=4, avg_degree=12)
    assert not torch.equal(a.edge_index, b.edge_index) and not torch.equal(a.x, b.x)


@pytest.mark.parametrize(
    "seed, avg_degree, homophily, degree_sigma",
    [(0, 2, 0.8, 1.2), (1, 2, 0.8, 1.2), (2, 3, 0.0, 2.5), (3, 40, 0.9, 0.1), (4, 8, 1.0, 1.2)],
)
def test_generator_invariants(seed, avg_degree, homophily, degree_sigma):
    """Exact counts, simple symmetric graph, every node covered: sparse graphs (many
    isolated nodes to rewire), no homophily, huge hubs (capped), near-regular degrees."""
    data = generate_reddit_like(0.004, seed=seed, avg_degree=avg_degree, homophily=homophily,
                                degree_sigma=degree_sigma)
    n = round(232_965 * 0.004)
    assert data.num_nodes == n and data.num_edges == 2 * round(n * avg_degree / 2)
    check_simple_symmetric(data.edge_index, n)
    assert int(degrees(data.edge_index, n).max()) <= n - 1
    if homophily == 0.0:
        assert edge_homophily(data) < 0.2  # chance ~0.03, plus the same-class rewiring of isolated nodes


def test_reddit_default_degree_keeps_the_shape():
    """Without avg_degree the real mean degree (~492) is kept: exact edge count."""
    scale = 0.01  # 2330 nodes, 1,146,159 pairs = 2,292,318 directed edges (dense: 42% of all pairs)
    data = generate_reddit_like(scale, seed=1)
    n = round(232_965 * scale)
    assert data.num_nodes == n and data.num_edges == 2 * round(114_615_892 * scale / 2)
    check_simple_symmetric(data.edge_index, n)


def test_reddit_loader_coalesces_and_reads_csr(tmp_path, reddit_small):
    sp = pytest.importorskip("scipy.sparse")
    n = reddit_small.num_nodes
    raw = tmp_path / "Reddit" / "raw"
    raw.mkdir(parents=True)
    types = 1 * reddit_small.train_mask + 2 * reddit_small.val_mask + 3 * reddit_small.test_mask
    np.savez(raw / "reddit_data.npz", feature=reddit_small.x.double().numpy(), label=reddit_small.y.int().numpy(),
             node_types=types.numpy())
    row, col = reddit_small.edge_index.numpy()
    perm = np.random.default_rng(0).permutation(row.size)
    dup = perm[:50]  # shuffled, with 50 duplicate edges
    adj = sp.coo_matrix((np.ones(row.size + 50), (row[np.r_[perm, dup]], col[np.r_[perm, dup]])), shape=(n, n))
    sp.save_npz(raw / "reddit_graph.npz", adj, compressed=True)
    loaded = Reddit(tmp_path, download=False)
    assert_same_dataset(loaded, reddit_small)
    sp.save_npz(raw / "reddit_graph.npz", sp.csr_matrix((np.ones(row.size), (row, col)), shape=(n, n)))
    assert torch.equal(Reddit(tmp_path, download=False).edge_index, reddit_small.edge_index)


def test_reddit_rejects_bad_files(tmp_path):
    raw = tmp_path / "Reddit" / "raw"
    raw.mkdir(parents=True)
    np.savez(raw / "reddit_data.npz", feature=np.zeros((3, 2), np.float32), label=np.zeros(3, np.int64),
             node_types=np.array([1, 2, 4]))
    np.savez(raw / "reddit_graph.npz", row=np.array([0], np.int32), col=np.array([1], np.int32),
             format=np.array(b"coo"), shape=np.array([3, 3]), data=np.ones(1, np.uint8))
    with pytest.raises(ValueError, match="node_types"):
        Reddit(tmp_path, download=False)
    np.savez(raw / "reddit_data.npz", feature=np.zeros((3, 2), np.float32), label=np.zeros(3, np.int64),
             node_types=np.array([1, 2, 3]))
    np.savez(raw / "reddit_graph.npz", row=np.array([0], np.int32), col=np.array([5], np.int32),
             format=np.array(b"coo"), shape=np.array([3, 3]), data=np.ones(1, np.uint8))
    with pytest.raises(ValueError, match="out of range"):
        Reddit(tmp_path, download=False)


def test_reddit_missing_files_clear_error(tmp_path):
    (tmp_path / "Reddit" / "raw").mkdir(parents=True)
    np.savez(tmp_path / "Reddit" / "raw" / "reddit_data.npz", feature=np.zeros((1, 1)))
    with pytest.raises(FileNotFoundError, match="reddit_graph.npz") as err:
        Reddit(tmp_path, download=False)
    assert str(tmp_path / "Reddit" / "raw") in str(err.value)


def test_reddit_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(reddit_module, "REDDIT_URL", (tmp_path / "nowhere" / "reddit.zip").as_uri())
    (tmp_path / "data").mkdir()  # a root must exist (tests/test_data_roots.py)
    with pytest.raises(FileNotFoundError, match="Download of .*reddit.zip failed"):
        Reddit(tmp_path / "data")
    assert not (tmp_path / "data" / "Reddit" / "raw" / "reddit.zip").exists()
    assert list((tmp_path / "data").iterdir()) == [], "a failed download creates no folder"


def test_reddit_download_unpacks_the_zip(tmp_path, monkeypatch, reddit_root, reddit_small):
    archive = tmp_path / "reddit.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("reddit_data.npz", "reddit_graph.npz"):
            zf.write(reddit_root / "Reddit" / "raw" / name, arcname=name)
    monkeypatch.setattr(reddit_module, "REDDIT_URL", archive.as_uri())
    (tmp_path / "data").mkdir()
    loaded = Reddit(tmp_path / "data")  # nothing there yet: downloads
    assert_same_dataset(loaded, reddit_small)
    assert sorted(p.name for p in (tmp_path / "data" / "Reddit" / "raw").iterdir()) == [
        "reddit_data.npz", "reddit_graph.npz"]


def test_writers_do_not_clobber_real_data(tmp_path, reddit_small):
    raw = tmp_path / "Reddit" / "raw"
    raw.mkdir(parents=True)
    np.savez(raw / "reddit_data.npz", feature=np.zeros((1, 1)))  # not written by reddit_like
    with pytest.raises(FileExistsError, match="overwrite=True"):
        reddit_like(tmp_path, REDDIT_SCALE, avg_degree=REDDIT_DEGREE)
    reddit_like(tmp_path, REDDIT_SCALE, avg_degree=REDDIT_DEGREE, overwrite=True)
    reddit_like(tmp_path, REDDIT_SCALE, avg_degree=REDDIT_DEGREE)  # its own files: replaced
    assert_same_dataset(Reddit(tmp_path, download=False), reddit_small)
    (tmp_path / "ogbn_arxiv").mkdir()
    (tmp_path / "ogbn_arxiv" / "RELEASE_v1.txt").write_text("the real thing")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ogbn_like(tmp_path, "arxiv", 0.002)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generator_on_cuda():
    data = generate_reddit_like(REDDIT_SCALE, seed=0, device="cuda", avg_degree=REDDIT_DEGREE)
    assert data.x.is_cuda and data.edge_index.is_cuda
    again = generate_reddit_like(REDDIT_SCALE, seed=0, device="cuda", avg_degree=REDDIT_DEGREE)
    assert_same_dataset(data, again)
    cpu = data.to("cpu")
    assert cpu.num_edges == 23300 and cpu.num_nodes == 1165
    check_simple_symmetric(cpu.edge_index, cpu.num_nodes)
    assert edge_homophily(cpu) > 0.4
    arxiv = generate_ogbn_like("arxiv", ARXIV_SCALE, device="cuda", to_undirected=False).to("cpu")
    assert arxiv.num_edges == round(1_166_243 * ARXIV_SCALE)


def test_coalesce_edge_index():
    ei = torch.tensor([[2, 0, 2, 1, 0], [1, 2, 1, 0, 2]])
    assert coalesce_edge_index(ei, 3).tolist() == [[0, 1, 2], [2, 0, 1]]
    done = torch.tensor([[0, 1], [1, 0]])
    assert coalesce_edge_index(done, 2) is done


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scale=0.0), "scale"),
        (dict(scale=1e-5), "nodes"),
        (dict(scale=0.002, avg_degree=400), "lower avg_degree"),
        (dict(scale=0.002, avg_degree=-1), "avg_degree"),
        (dict(scale=0.002, avg_degree=1.5), "raise avg_degree"),
        (dict(scale=0.002, avg_degree=30, homophily=1.0), "lower homophily"),
        (dict(scale=0.002, avg_degree=10, homophily=1.5), "homophily"),
        (dict(scale=0.002, avg_degree=10, class_sep=0), "class_sep"),
    ],
)
def test_generator_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_reddit_like(**kwargs)


# --------------------------------------------------------------------------- OGB


@pytest.fixture(scope="module")
def ogb_loader():
    pytest.importorskip("ogb", reason="the OGB loader needs the optional 'ogb' package")
    from fusegnn.datasets import ogb as ogb_loader

    return ogb_loader


@pytest.fixture(scope="module")
def arxiv_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ogb")
    written = ogbn_like(root, "arxiv", ARXIV_SCALE, seed=0)
    assert written == root / "ogbn_arxiv"
    return root


def test_ogbn_like_writes_ogb_layout(arxiv_root):
    base = arxiv_root / "ogbn_arxiv"
    files = sorted(str(p.relative_to(base)) for p in base.rglob("*"))
    assert files == sorted([
        "RELEASE_v1.txt", "processed", "raw", "split", "split/time",
        *(f"raw/{f}.csv.gz"
          for f in ("edge", "node-feat", "node-label", "num-node-list", "num-edge-list", "node_year")),
        *(f"split/time/{s}.csv.gz" for s in ("train", "valid", "test")),
    ])


def test_ogb_arxiv_roundtrip_and_cache(ogb_loader, arxiv_root, tmp_path):
    torch_load, ogb_cls = torch.load, __import__("ogb.nodeproppred", fromlist=["x"]).NodePropPredDataset
    pre_process = ogb_cls.pre_process
    spec = OGBN_SPECS["ogbn-arxiv"]
    n, e = round(spec.num_nodes * ARXIV_SCALE), round(spec.num_edges * ARXIV_SCALE)
    root = tmp_path / "copy"
    shutil.copytree(arxiv_root, root)
    cache = root / "ogbn_arxiv" / "processed" / "data_processed"
    directed = ogb_loader.OGBNodeDataset("ogbn-arxiv", root, to_undirected=False, download=False)
    assert cache.is_file()  # ogb wrote its cache; the next loads read it (torch.load weights_only issue)
    undirected = ogb_loader.OGBNodeDataset("arxiv", root, download=False)
    again = ogb_loader.OGBNodeDataset("ogbn_arxiv", root, to_undirected=False, download=False)
    assert torch.load is torch_load and ogb_cls.pre_process is pre_process  # nothing patched

    assert_same_dataset(directed, generate_ogbn_like("arxiv", ARXIV_SCALE, seed=0, to_undirected=False))
    assert_same_dataset(undirected, generate_ogbn_like("arxiv", ARXIV_SCALE, seed=0))
    assert_same_dataset(again, directed)
    ogbn_like(root, "arxiv", ARXIV_SCALE, seed=1)  # regenerated: ogb's stale cache must go too
    assert not cache.exists()
    other = ogb_loader.OGBNodeDataset("arxiv", root, to_undirected=False, download=False)
    assert_same_dataset(other, generate_ogbn_like("arxiv", ARXIV_SCALE, seed=1, to_undirected=False))
    assert (directed.num_nodes, directed.num_edges, directed.num_features, directed.num_classes) == (n, e, 128, 40)
    assert undirected.num_edges == 2 * e and undirected.extra["ogb_num_edges"] == e
    check_simple_symmetric(undirected.edge_index, n)
    val, test = round(n * 29_799 / 169_343), round(n * 48_603 / 169_343)
    split = directed.extra["split_idx"]
    assert [split[k].numel() for k in ("train", "valid", "test")] == [n - val - test, val, test]
    assert torch.equal(directed.train_mask.nonzero().squeeze(1), split["train"])
    year = directed.extra["node_year"]
    assert int(year[split["train"]].max()) <= 2017 and bool((year[split["valid"]] == 2018).all())
    assert int(year[split["test"]].min()) >= 2019
    src, dst = directed.edge_index
    assert bool((year[src] >= year[dst]).all()), "a paper cites a newer one"
    assert edge_homophily(undirected) > 0.4
    evaluator = directed.extra["evaluator"]
    y = directed.y[:, None]
    assert evaluator.eval({"y_true": y, "y_pred": y})["acc"] == 1.0


def test_ogb_products_roundtrip(ogb_loader, tmp_path):
    ogbn_like(tmp_path, "products", PRODUCTS_SCALE, seed=2, avg_degree=PRODUCTS_DEGREE)
    spec = OGBN_SPECS["ogbn-products"]
    n = round(spec.num_nodes * PRODUCTS_SCALE)
    pairs = round(n * PRODUCTS_DEGREE / 2)
    raw = ogb_loader.OGBNodeDataset("products", tmp_path, to_undirected=False, download=False)
    assert (raw.num_nodes, raw.num_edges, raw.num_features, raw.num_classes) == (n, 2 * pairs, 100, 47)
    assert torch.equal(raw.edge_index[:, 1::2], raw.edge_index[:, 0::2].flip(0))  # ogb's add_inverse_edge
    data = ogb_loader.OGBNodeDataset("ogbn-products", tmp_path, download=False)
    assert_same_dataset(data, generate_ogbn_like("products", PRODUCTS_SCALE, seed=2, avg_degree=PRODUCTS_DEGREE))
    assert data.num_edges == 2 * pairs
    check_simple_symmetric(data.edge_index, n)
    val, test = round(n * 39_323 / 2_449_029), round(n * 2_213_091 / 2_449_029)
    assert split_sizes(data) == (n - val - test, val, test)
    assert "node_year" not in data.extra and data.extra["evaluator"].name == "ogbn-products"


def test_ogb_missing_files_clear_error(ogb_loader, tmp_path):
    with pytest.raises(FileNotFoundError, match="edge.csv.gz"):
        ogb_loader.OGBNodeDataset("arxiv", tmp_path, download=False)
    with pytest.raises(ValueError, match="ogbn-arxiv"):
        ogb_loader.OGBNodeDataset("ogbn-mag", tmp_path)


def test_ogb_download_failure_and_success(ogb_loader, arxiv_root, tmp_path, monkeypatch):
    meta = ogb_loader._meta("ogbn-arxiv")
    monkeypatch.setattr(ogb_loader, "_meta", lambda name: dict(meta, url=(tmp_path / "no" / "arxiv.zip").as_uri()))
    (tmp_path / "data").mkdir()  # a root must exist (tests/test_data_roots.py)
    with pytest.raises(FileNotFoundError, match="Download of .*arxiv.zip failed"):
        ogb_loader.OGBNodeDataset("arxiv", tmp_path / "data")
    assert list((tmp_path / "data").iterdir()) == [], "a failed download creates no folder"
    archive = tmp_path / "arxiv.zip"
    with zipfile.ZipFile(archive, "w") as zf:  # OGB's zip: one top folder named download_name
        for path in (arxiv_root / "ogbn_arxiv").rglob("*"):
            zf.write(path, arcname=str(Path("arxiv") / path.relative_to(arxiv_root / "ogbn_arxiv")))
    monkeypatch.setattr(ogb_loader, "_meta", lambda name: dict(meta, url=archive.as_uri()))
    data = ogb_loader.OGBNodeDataset("arxiv", tmp_path / "data")
    assert_same_dataset(data, generate_ogbn_like("arxiv", ARXIV_SCALE, seed=0))
    assert not (tmp_path / "data" / "arxiv.zip").exists()


def test_generate_ogbn_like_rejects_unknown_name():
    with pytest.raises(ValueError, match="ogbn-arxiv"):
        generate_ogbn_like("mag", 0.01)
