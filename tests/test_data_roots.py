"""Where the loaders look and where they write (:mod:`fusegnn.datasets.paths`).

Loaders never write where they only read: no folder before a download has succeeded,
nothing into ``$FUSEGNN_DATA`` or a read-only folder (a ``chmod``-ed copy proves it: the
loaders treat a folder without write bits as read-only even for the superuser); a root
that does not exist is an error naming it; a root one level too deep is read; one
message per missing data set. The network is replaced: ``urllib.request.urlopen`` either
fails (offline) or serves local copies, so no test downloads anything.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fusegnn.datasets import Planetoid, Reddit, load_dataset, paths
from fusegnn.datasets.planetoid import PLANETOID_URL, planetoid_raw_file_names


def _shared_root() -> Path | None:
    env = os.environ.get("FUSEGNN_DATA")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "planetoid")
    for candidate in candidates:
        if (candidate / "Cora" / "raw" / "ind.cora.graph").is_file():
            return candidate
    return None


SHARED = _shared_root()
needs_data = pytest.mark.skipif(SHARED is None, reason="Planetoid raw files not found ($FUSEGNN_DATA or ../shared/data/planetoid)")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No $FUSEGNN_DATA, a cache that does not exist yet, and no network."""
    monkeypatch.delenv("FUSEGNN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    calls: list[str] = []

    def offline(url, *args, **kwargs):
        calls.append(url if isinstance(url, str) else url.full_url)
        raise urllib.error.URLError("network is unreachable (test)")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    return calls


def _copy(name: str, base: Path, skip: tuple[str, ...] = ()) -> Path:
    target = base / name / "raw"
    target.mkdir(parents=True)
    for file in (SHARED / name / "raw").iterdir():
        if file.name not in skip:
            shutil.copy(file, target / file.name)
    return target


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def read_only(tmp_path):
    """``make(folder)``: remove every write bit under ``folder`` (restored afterwards)."""
    made: list[Path] = []

    def make(folder: Path) -> Path:
        for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        made.append(folder)
        return folder

    yield make
    for folder in made:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ----------------------------------------------------------------------------- a root that does not exist


@needs_data
@pytest.mark.parametrize("download", [True, False])
def test_missing_root_is_an_error_naming_it(tmp_path, monkeypatch, _isolated, download):
    monkeypatch.setenv("FUSEGNN_DATA", str(SHARED))  # has Cora: still an error, not a silent fallback
    missing = tmp_path / "nonexistent" / "dir"
    for load in (lambda: Planetoid(missing, "Cora", download=download),
                 lambda: Reddit(missing, download=download),
                 lambda: load_dataset("CiteSeer", str(missing))):
        with pytest.raises(FileNotFoundError, match="does not exist") as info:
            load()
        assert str(missing) in str(info.value)
    assert not (tmp_path / "nonexistent").exists(), "no folder created"
    assert _isolated == [], "no download attempted"


def test_root_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        Planetoid(tmp_path / "file", "Cora", download=False)


# ----------------------------------------------------------------------------- a root one level too deep


@needs_data
@pytest.mark.parametrize("depth", ["Cora", "Cora/raw"])
def test_root_one_level_too_deep_is_read(tmp_path, depth):
    raw = _copy("Cora", tmp_path / "planetoid")
    data = Planetoid(tmp_path / "planetoid" / depth, "Cora", download=False)
    assert Path(data.extra["raw_dir"]) == raw and data.num_nodes == 2708
    assert _entries(raw.parent) == ["raw"], "no Cora/Cora or Cora/raw/Cora/raw created"


@pytest.mark.parametrize("depth, target", [("Cora", "Cora/raw"), ("Cora/raw", "Cora/raw"), ("", "Cora/raw")])
def test_download_into_a_root_one_level_too_deep_goes_to_its_folder(tmp_path, _isolated, depth, target):
    root = tmp_path / "planetoid" / depth
    root.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(root, "Cora")
    assert f"it was to go into {tmp_path / 'planetoid' / target}." in str(info.value)
    assert _isolated[0] == f"{PLANETOID_URL}/ind.cora.x"
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == sorted(
        str(Path("planetoid", *Path(depth).parts[:k])) for k in range(len(Path(depth).parts) + 1)
    ), "the failed download left nothing behind"


# ----------------------------------------------------------------------------- read-only data


@needs_data
def test_pubmed_in_read_only_fusegnn_data_writes_nothing_there(tmp_path, monkeypatch, read_only, _isolated):
    """PubMed lacks allx in the shared copy: the loader looks for it in the cache, tries
    to download it there (offline here), and says so once; the data folder is untouched."""
    shared = tmp_path / "shared"
    _copy("PubMed", shared, skip=("ind.pubmed.allx",))
    read_only(shared)
    before = _snapshot(shared)
    monkeypatch.setenv("FUSEGNN_DATA", str(shared))
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(None, "PubMed")
    message = str(info.value)
    assert _snapshot(shared) == before
    assert not (tmp_path / "xdg").exists(), "the failed download created no cache folder"
    assert _entries(tmp_path) == ["shared"], "no staging folder left behind"
    assert _isolated and all(url.startswith(PLANETOID_URL) for url in _isolated)
    # one message: which file is missing where, where the download went, how to get it
    assert message.count("not found") == 1
    assert f"found PubMed in {shared / 'PubMed' / 'raw'} but ind.pubmed.allx is missing [$FUSEGNN_DATA]" in message
    assert f"it was to go into {tmp_path / 'xdg' / 'fusegnn' / 'PubMed' / 'raw'}" in message
    assert f"download {PLANETOID_URL}/ind.pubmed.allx" in message


@needs_data
def test_read_only_root_is_not_downloaded_into(tmp_path, read_only, _isolated):
    root = tmp_path / "mine"
    _copy("PubMed", root, skip=("ind.pubmed.allx",))
    read_only(root)
    before = _snapshot(root)
    with pytest.raises(FileNotFoundError, match="Not downloaded: .* may not be written .* is read-only") as info:
        Planetoid(root, "PubMed")
    assert "ind.pubmed.allx is missing" in str(info.value)
    assert _isolated == [], "nothing fetched for a folder that cannot take it"
    assert _snapshot(root) == before


def test_fusegnn_data_is_never_a_download_target(tmp_path, monkeypatch, _isolated):
    monkeypatch.setenv("FUSEGNN_DATA", str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    assert not paths.is_writable(tmp_path / "shared" / "Cora" / "raw")
    assert paths.is_writable(tmp_path / "elsewhere" / "Cora")
    # asked to download into a root inside $FUSEGNN_DATA, it refuses before fetching
    with pytest.raises(FileNotFoundError, match=r"Not downloaded: .* only reads"):
        Planetoid(tmp_path / "shared", "Cora")
    assert _isolated == [] and _entries(tmp_path / "shared") == []


# ----------------------------------------------------------------------------- the download itself


def _serve(files: dict[str, bytes], fail: set[str] = frozenset()):
    """A fake ``urlopen`` that serves ``files`` by the URL's last path component."""

    def urlopen(url, *args, **kwargs):
        name = url.rsplit("/", 1)[-1]
        if name in fail or name not in files:
            raise urllib.error.URLError(f"{name}: not served (test)")
        return io.BytesIO(files[name])

    return urlopen


@needs_data
def test_download_goes_to_the_cache_and_creates_its_folder_only_on_success(tmp_path, monkeypatch):
    names = planetoid_raw_file_names("Cora")
    served = {f: (SHARED / "Cora" / "raw" / f).read_bytes() for f in names}
    # the last file fails: no folder, no partial file
    monkeypatch.setattr(urllib.request, "urlopen", _serve(served, fail={names[-1]}))
    with pytest.raises(FileNotFoundError, match=f"Download of .* failed .*{names[-1]}"):
        Planetoid(None, "Cora")
    assert _entries(tmp_path) == [], "nothing created, not even the cache folder"
    monkeypatch.setattr(urllib.request, "urlopen", _serve(served))
    data = Planetoid(None, "Cora")
    cache = tmp_path / "xdg" / "fusegnn" / "Cora" / "raw"
    assert Path(data.extra["raw_dir"]) == cache and data.num_nodes == 2708
    assert _entries(cache) == sorted(names) and _entries(tmp_path / "xdg") == ["fusegnn"]


# ----------------------------------------------------------------------------- OGB


@pytest.fixture(scope="module")
def arxiv_copy(tmp_path_factory) -> Path:
    pytest.importorskip("ogb", reason="the OGB loader needs the optional 'ogb' package")
    from fusegnn.datasets.synthetic import ogbn_like

    root = tmp_path_factory.mktemp("ogb")
    ogbn_like(root, "arxiv", 0.005, seed=0)
    return root


def test_ogb_parse_cache_goes_to_the_cache_for_read_only_data(tmp_path, monkeypatch, arxiv_copy, read_only):
    from fusegnn.datasets import ogb as ogb_loader

    shared = tmp_path / "shared"
    shutil.copytree(arxiv_copy, shared)
    read_only(shared)
    before = _snapshot(shared)
    monkeypatch.setenv("FUSEGNN_DATA", str(shared))
    first = ogb_loader.OGBNodeDataset("arxiv", download=False)
    assert _snapshot(shared) == before, "nothing written into the read-only data"
    caches = list((tmp_path / "xdg" / "fusegnn" / "ogb-processed").glob("ogbn_arxiv-*/data_processed"))
    assert len(caches) == 1

    def no_parse(*args):
        raise AssertionError("parsed again: the cache was not read")

    monkeypatch.setattr(ogb_loader, "_parse_raw", no_parse)
    again = ogb_loader.OGBNodeDataset("arxiv", download=False)
    assert again.num_nodes == first.num_nodes and bool((again.edge_index == first.edge_index).all())
    # the same data given as the folder itself (one level too deep) is read too
    deep = ogb_loader.OGBNodeDataset("arxiv", shared / "ogbn_arxiv", download=False)
    assert deep.extra["root"] == str(shared / "ogbn_arxiv")


def test_ogb_missing_package_names_the_install_script(monkeypatch):
    from fusegnn.datasets import ogb as ogb_loader

    monkeypatch.setitem(sys.modules, "ogb", None)
    monkeypatch.setitem(sys.modules, "ogb.nodeproppred", None)
    with pytest.raises(ImportError) as info:
        ogb_loader.OGBNodeDataset("arxiv")
    message = str(info.value)
    assert "./install.sh ogb" in message and "pip install -e '.[ogb]'" in message
    assert "fusegnn[ogb]" not in message  # the package is not published: never suggested


def test_fusegnn_data_that_does_not_exist_is_named_in_the_message(tmp_path, monkeypatch):
    """A mistyped $FUSEGNN_DATA is searched like any folder (not an error of its own, as a
    missing root= is), so the missing-data message says that the variable's folder does
    not exist, naming the variable and its value."""
    typo = tmp_path / "planetiod"
    monkeypatch.setenv("FUSEGNN_DATA", str(typo))
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(None, "Cora", download=False)
    message = str(info.value)
    assert f"{typo / 'Cora' / 'raw'}: does not exist [$FUSEGNN_DATA]" in message
    assert f"FUSEGNN_DATA={typo} itself does not exist: is it mistyped?" in message
    assert not typo.exists() and not (tmp_path / "xdg").exists()
    typo.mkdir()  # an existing folder without the data set: no such line
    with pytest.raises(FileNotFoundError) as info:
        Planetoid(None, "Cora", download=False)
    assert "itself does not exist" not in str(info.value)
