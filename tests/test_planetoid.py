"""Planetoid loader: counts and splits against shared/data/README.md, parity with PyG.

Data: ``$FUSEGNN_DATA`` if set, else ``<repo>/../shared/data/planetoid``; tests that need a
data set skip when it is not there. No test touches the network: downloads are replaced
by a function that fails the test (or, where the download path is tested, copies local
files).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fusegnn.datasets import paths
from fusegnn.datasets.planetoid import PLANETOID_URL, Planetoid, planetoid_raw_file_names


def _data_root() -> Path | None:
    env = os.environ.get("FUSEGNN_DATA")
    if env:
        return Path(env)
    fallback = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "planetoid"
    return fallback if fallback.is_dir() else None


DATA_ROOT = _data_root()

# From shared/data/README.md.
EXPECTED = {
    "Cora": dict(nodes=2708, edges=10556, features=1433, classes=7, split=(140, 500, 1000), padded=0),
    "CiteSeer": dict(nodes=3327, edges=9104, features=3703, classes=6, split=(120, 500, 1000), padded=15),
}


def _raw_dir(name: str) -> Path:
    if DATA_ROOT is None:
        pytest.skip("no Planetoid data: set FUSEGNN_DATA or provide ../shared/data/planetoid")
    directory = DATA_ROOT / name / "raw"
    if not directory.is_dir():
        pytest.skip(f"{directory} does not exist")
    return directory


def _copy_raw(name: str, base: Path, skip: tuple[str, ...] = ()) -> Path:
    """Copy ``<DATA_ROOT>/<name>/raw`` to ``<base>/<name>/raw`` (minus ``skip``)."""
    source = _raw_dir(name)
    target = base / name / "raw"
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.name not in skip:
            shutil.copy(file, target / file.name)
    return target


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    """An empty cache directory, and any download attempt fails the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))

    def no_network(urls, directory, timeout=30.0):
        raise AssertionError(f"test tried to download {list(urls)} into {directory}")

    monkeypatch.setattr(paths, "download_files", no_network)


_CACHE: dict[tuple, object] = {}


def _load(name: str, **kwargs):
    """Planetoid(DATA_ROOT, name, ...) memoised (loads take ~0.2 s)."""
    _raw_dir(name)
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _CACHE:
        _CACHE[key] = Planetoid(DATA_ROOT, name, download=False, **kwargs)
    return _CACHE[key]


# ----------------------------------------------------------------------------- counts, public split


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_counts_and_public_split(name):
    expected = EXPECTED[name]
    data = _load(name)
    n = expected["nodes"]
    assert data.name == name
    assert data.num_nodes == n
    assert data.num_edges == expected["edges"]
    assert data.num_features == expected["features"]
    assert data.num_classes == expected["classes"]
    assert data.x.dtype == torch.float32 and data.x.shape == (n, expected["features"])
    assert data.y.dtype == torch.int64 and data.y.shape == (n,)
    assert int(data.y.min()) >= 0 and int(data.y.max()) == expected["classes"] - 1
    assert data.edge_index.dtype == torch.int64
    for mask in (data.train_mask, data.val_mask, data.test_mask):
        assert mask.dtype == torch.bool and mask.shape == (n,)

    n_train, n_val, n_test = expected["split"]
    assert (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum())) == expected["split"]
    assert not (data.train_mask & data.val_mask).any()
    assert not (data.train_mask & data.test_mask).any()
    assert not (data.val_mask & data.test_mask).any()
    # Planetoid's public split: train = first len(y) ids, val = the next 500.
    assert torch.equal(data.train_mask.nonzero().view(-1), torch.arange(n_train))
    assert torch.equal(data.val_mask.nonzero().view(-1), torch.arange(n_train, n_train + n_val))
    assert torch.bincount(data.y[data.train_mask], minlength=data.num_classes).tolist() == [20] * data.num_classes
    # The test ids are exactly test.index.
    test_ids = sorted(int(t) for t in (_raw_dir(name) / f"ind.{name.lower()}.test.index").read_text().split())
    assert data.test_mask.nonzero().view(-1).tolist() == test_ids
    assert data.extra["split"] == "public"
    assert Path(data.extra["raw_dir"]) == _raw_dir(name)


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_edges_coalesced_undirected_no_self_loops(name):
    data = _load(name)
    src, dst = data.edge_index
    n = data.num_nodes
    assert int(data.edge_index.min()) >= 0 and int(data.edge_index.max()) < n
    assert not (src == dst).any()
    key = dst * n + src
    assert torch.all(key[1:] > key[:-1]), "edges must be sorted by (target, source) without duplicates"
    assert torch.equal(torch.sort(src * n + dst).values, key), "every edge must appear in both directions"


def test_citeseer_padded_nodes():
    data = _load("CiteSeer")
    padded = data.extra["padded_mask"]
    assert int(padded.sum()) == EXPECTED["CiteSeer"]["padded"]
    ids = padded.nonzero().view(-1)
    assert int(ids.min()) >= 2312  # inside the test-id range, after allx's 2312 rows
    assert not data.x[padded].any()
    assert (data.y[padded] == 0).all()
    assert not (padded & (data.train_mask | data.val_mask | data.test_mask)).any()
    # Despite the usual name "isolated test ids", these documents are cited (they have
    # edges); they only lack features and labels in the files. Their edges are kept.
    degree = torch.bincount(data.edge_index[1], minlength=data.num_nodes)
    assert int(degree[ids].min()) >= 1
    assert not _load("Cora").extra["padded_mask"].any()


# ----------------------------------------------------------------------------- features


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_normalize_features(name):
    raw = _load(name)
    data = _load(name, normalize_features=True)
    row_sum = data.x.sum(dim=1)
    zero = ~raw.x.any(dim=1)
    assert torch.allclose(row_sum[~zero], torch.ones(int((~zero).sum())), atol=1e-5)
    assert not data.x[zero].any()
    if name == "CiteSeer":
        assert int(zero.sum()) >= EXPECTED[name]["padded"]
    expected = raw.x.double() / raw.x.double().sum(1, keepdim=True).clamp(min=1e-300)
    torch.testing.assert_close(data.x.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(data.edge_index, raw.edge_index) and torch.equal(data.y, raw.y)
    assert torch.equal(raw.x, (raw.x > 0).float()), "unnormalised Cora/CiteSeer features are binary"


# ----------------------------------------------------------------------------- other splits


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_full_split(name):
    public, data = _load(name), _load(name, split="full")
    padded = data.extra["padded_mask"]
    assert torch.equal(data.val_mask, public.val_mask) and torch.equal(data.test_mask, public.test_mask)
    assert torch.equal(data.train_mask, ~(data.val_mask | data.test_mask | padded))
    assert int(data.train_mask.sum()) == data.num_nodes - 1500 - EXPECTED[name]["padded"]
    assert data.extra["split"] == "full"


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_random_split(name):
    data = _load(name, split="random", num_train_per_class=7, num_val=300, num_test=600, seed=3)
    padded = data.extra["padded_mask"]
    assert int(data.train_mask.sum()) == 7 * data.num_classes
    assert torch.bincount(data.y[data.train_mask], minlength=data.num_classes).tolist() == [7] * data.num_classes
    assert int(data.val_mask.sum()) == 300 and int(data.test_mask.sum()) == 600
    masks = torch.stack([data.train_mask, data.val_mask, data.test_mask, padded]).long()
    assert int(masks.sum(0).max()) == 1, "train/val/test/padded must be disjoint"

    again = Planetoid(DATA_ROOT, name, split="random", num_train_per_class=7, num_val=300,
                      num_test=600, seed=3, download=False)
    for a, b in [(data.train_mask, again.train_mask), (data.val_mask, again.val_mask), (data.test_mask, again.test_mask)]:
        assert torch.equal(a, b), "same seed, same split"
    other = _load(name, split="random", num_train_per_class=7, num_val=300, num_test=600, seed=4)
    assert not torch.equal(other.train_mask, data.train_mask)

    default = _load(name, split="RANDOM")
    counts = (int(default.train_mask.sum()), int(default.val_mask.sum()), int(default.test_mask.sum()))
    assert counts == (20 * data.num_classes, 500, 1000)


def test_random_split_too_large():
    _raw_dir("Cora")
    with pytest.raises(ValueError, match="num_val \\+ num_test"):
        Planetoid(DATA_ROOT, "Cora", split="random", num_val=2000, num_test=1000, download=False)


# ----------------------------------------------------------------------------- names and arguments


def test_name_case_insensitive():
    assert _load("Cora").name == "Cora"
    _raw_dir("CiteSeer")
    data = Planetoid(DATA_ROOT, "citeseer", download=False)
    assert data.name == "CiteSeer" and data.num_nodes == 3327
    assert planetoid_raw_file_names("PUBMED")[2] == "ind.pubmed.allx"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="Reddit"), "Cora, CiteSeer, PubMed"),
        (dict(name="cora", split="geom-gcn"), "public, full, random"),
        (dict(name="cora", num_val=-1), "num_val"),
        (dict(name="cora", num_train_per_class=2.5), "num_train_per_class"),
    ],
)
def test_bad_arguments(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        Planetoid(tmp_path, download=False, **kwargs)


def test_root_takes_precedence_over_env(tmp_path, monkeypatch):
    copy = _copy_raw("Cora", tmp_path / "mine")
    monkeypatch.setenv("FUSEGNN_DATA", str(DATA_ROOT))
    assert Path(Planetoid(tmp_path / "mine", "Cora", download=False).extra["raw_dir"]) == copy
    # Without root, FUSEGNN_DATA is used ...
    assert Path(Planetoid(None, "Cora", download=False).extra["raw_dir"]) == DATA_ROOT / "Cora" / "raw"
    monkeypatch.setenv("FUSEGNN_DATA", str(tmp_path / "mine"))
    assert Path(Planetoid(name="Cora", download=False).extra["raw_dir"]) == copy
    # ... and a root without the data set falls back to it.
    (tmp_path / "empty").mkdir()
    assert Path(Planetoid(tmp_path / "empty", "Cora", download=False).extra["raw_dir"]) == copy


# ----------------------------------------------------------------------------- missing files


def test_pubmed_missing_allx_is_named(monkeypatch):
    raw = _raw_dir("PubMed")
    if (raw / "ind.pubmed.allx").exists():
        pytest.skip("this PubMed copy is complete")
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(DATA_ROOT, "PubMed", download=False)
    message = str(info.value)
    assert f"found PubMed in {raw} but ind.pubmed.allx is missing" in message
    assert f"{PLANETOID_URL}/ind.pubmed.allx" in message
    assert "download=False" in message
    # The generic part still lists where it searched.
    assert str(raw) in message and "FUSEGNN_DATA" in message


def test_failed_download_is_reported(tmp_path, monkeypatch):
    _copy_raw("PubMed", tmp_path, skip=("ind.pubmed.allx",))
    requested = {}

    def offline(urls, directory, timeout=30.0):
        requested.update(urls)
        raise OSError("network is unreachable")

    monkeypatch.setattr(paths, "download_files", offline)
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(tmp_path, "PubMed")
    assert requested == {"ind.pubmed.allx": f"{PLANETOID_URL}/ind.pubmed.allx"}, "only the missing file"
    message = str(info.value)
    assert "ind.pubmed.allx is missing" in message and "network is unreachable" in message


def test_download_path_fetches_canonical_urls(tmp_path, monkeypatch):
    source = _raw_dir("Cora")
    requested = {}

    def fake_download(urls, directory, timeout=30.0):  # "downloads" from the local copy
        requested.update(urls)
        directory.mkdir(parents=True, exist_ok=True)
        for file in urls:
            shutil.copy(source / file, directory / file)

    monkeypatch.setattr(paths, "download_files", fake_download)
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    data = Planetoid(tmp_path, "cora")
    assert requested == {f: f"{PLANETOID_URL}/{f}" for f in planetoid_raw_file_names("Cora")}
    assert PLANETOID_URL == "https://github.com/kimiyoung/planetoid/raw/master/data"
    assert Path(data.extra["raw_dir"]) == tmp_path / "Cora" / "raw"
    assert data.num_nodes == 2708 and data.num_edges == 10556


def test_wrongly_cased_folder_hint(tmp_path, monkeypatch):
    _copy_raw("Cora", tmp_path / "base").parent.rename(tmp_path / "base" / "cora")
    if (tmp_path / "base" / "Cora").exists():
        pytest.skip("case-insensitive file system")
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="folder must be named 'Cora'"):
        Planetoid(tmp_path / "base", "Cora", download=False)


def test_missing_scipy_says_pip_install(monkeypatch):
    _raw_dir("Cora")
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.sparse", None)
    with pytest.raises(ImportError, match="pip install scipy"):
        Planetoid(DATA_ROOT, "Cora", download=False)


class _Evil:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_untrusted_pickle_is_refused(tmp_path):
    raw = _copy_raw("Cora", tmp_path)
    (raw / "ind.cora.graph").write_bytes(pickle.dumps(_Evil(), protocol=2))
    with pytest.raises(ValueError, match="refusing to load (__builtin__|builtins).eval"):
        Planetoid(tmp_path, "Cora", download=False)


def test_malformed_test_index(tmp_path):
    raw = _copy_raw("Cora", tmp_path)
    (raw / "ind.cora.test.index").write_text("1708\nnot-a-number\n")
    with pytest.raises(ValueError, match="ind.cora.test.index"):
        Planetoid(tmp_path, "Cora", download=False)


# ----------------------------------------------------------------------------- parity with PyG


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_matches_torch_geometric(name, tmp_path):
    pyg = pytest.importorskip("torch_geometric.datasets")
    transforms = pytest.importorskip("torch_geometric.transforms")
    _copy_raw(name, tmp_path)
    ref = pyg.Planetoid(str(tmp_path), name)[0]  # finds the raw files, never downloads
    ours = _load(name)

    assert torch.equal(ours.x, ref.x)
    assert torch.equal(ours.y, ref.y)
    assert torch.equal(ours.edge_index, ref.edge_index)  # same (target, source) order
    for mask in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(ours, mask), getattr(ref, mask)), mask

    # Binary features: PyG's NormalizeFeatures agrees with ours.
    normalized = transforms.NormalizeFeatures()(ref.clone())
    torch.testing.assert_close(_load(name, normalize_features=True).x, normalized.x, rtol=1e-6, atol=0)

    # split="full": PyG also trains on the padded placeholders; otherwise identical.
    ref_full = pyg.Planetoid(str(tmp_path), name, split="full")[0]
    full = _load(name, split="full")
    assert torch.equal(full.train_mask, ref_full.train_mask & ~full.extra["padded_mask"])
    assert torch.equal(full.val_mask, ref_full.val_mask) and torch.equal(full.test_mask, ref_full.test_mask)
