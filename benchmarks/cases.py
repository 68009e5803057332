"""The case grids of the two suites.

Suite ``paper`` (fuseGNN, Chen et al. 2020 / Chen's thesis ch. 5: Table 5.2 and
Figure 5.11), one training step of a 2-layer model per case, named
``{model}-{dataset}-{width}``:

* GCN on Cora, PubMed and Reddit-like at hidden 16, 64 and 512 (Table 5.2) and 128
  (Figure 5.11, peak memory): ``gcn-cora-h16`` ... ``gcn-reddit-h512``;
* GAT with one head of width 16, 64, 512 and 128 on every data set
  (``gat-cora-1x16`` ...), plus the published recipe of 8 heads x 8 on the small graphs
  (``gat-cora-8x8``, ``gat-pubmed-8x8``) and 8 heads x 16 on Reddit-like
  (``gat-reddit-8x16``);
* on CiteSeer the two published recipes only, ``gcn-citeseer-h16`` and
  ``gat-citeseer-8x8`` (the third small graph of the CUDA-graph comparison: on graphs
  this size a step is bound by kernel launches, not by the sparse kernels);
* the layer library (issue #14) on Cora, PubMed and Reddit-like: GraphSAGE (mean) and
  GIN at hidden 16, 64 and 128 (``sage-cora-h16`` ..., ``gin-reddit-h64``) and GATv2 with
  1 head x 16 and 8 heads x 16 (``gatv2-pubmed-1x16``, ``gatv2-reddit-8x16``); on
  Reddit-like each also with the input cut to its first 64 features (suffix ``-in64``,
  ``sage-reddit-h128-in64``): PyG fits in an H100's memory only with the narrow input.

* a mid-size graph, the ogbn-arxiv-sized generated graph (169,343 nodes, 2.3M edges
  after symmetrisation, 128 features, 40 classes; ``generate_ogbn_like("arxiv")``), where a
  step is bound neither by launches nor by huge degrees: GCN at hidden 128 and 256,
  GraphSAGE and GIN at 128, GAT 8 x 8 and 1 x 64, GATv2 8 x 16 (``gcn-arxiv-h128`` ...).

Suite ``agg``: the aggregation alone, ``out = A @ x`` with the GCN-normalised Reddit-like
adjacency (self-loops included), forward and backward, at ``F`` in 16, 64, 128, 256:
``agg-reddit-f16`` ... ``agg-reddit-f256``.

``--quick`` keeps the cases marked ``quick``: every small-graph and arxiv-sized case
(they take milliseconds) and the Reddit-like cases at width 16 and 128 plus ``gat-reddit-8x16``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

__all__ = ["Case", "SUITES", "suite_cases", "select_cases"]

SUITES = ("paper", "agg")

_PAPER_DATASETS = ("cora", "pubmed", "reddit")
_PAPER_HIDDEN = (16, 64, 128, 512)  # 128: Figure 5.11 (peak memory)
_AGG_FEATURES = (16, 64, 128, 256)
_QUICK_REDDIT_WIDTHS = (16, 128)
_LIBRARY_HIDDEN = (16, 64, 128)
# the Reddit-like layer-library cases --quick keeps (the targets)
_QUICK_LIBRARY = ("sage-reddit-h128", "gin-reddit-h64", "gatv2-reddit-1x16", "gatv2-reddit-8x16")
NARROW_INPUT = 64  # the "-in64" cases' input width


@dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes:
        name: the case name used in results (``gcn-cora-h16``, ``gat-reddit-8x16``,
            ``agg-reddit-f64``).
        suite: ``"paper"`` or ``"agg"``.
        dataset: ``"cora"``, ``"citeseer"``, ``"pubmed"`` or ``"reddit"`` (Reddit-like,
            generated).
        model: ``"gcn"``, ``"gat"``, ``"sage"``, ``"gin"``, ``"gatv2"``, or ``"spmm"`` for
            the ``agg`` suite.
        width: hidden width per head (``paper``) or feature width ``F`` (``agg``).
        heads: attention heads of the first GAT layer (1 otherwise).
        quick: kept by ``--quick``.
        note: where the case comes from.
        in_features: the input width when the data set's features are cut to their first
            ``in_features`` columns (``-in64`` cases), else ``None`` (all of them).
    """

    name: str
    suite: str
    dataset: str
    model: str
    width: int
    heads: int = 1
    quick: bool = True
    note: str = ""
    in_features: int | None = None

    def info(self) -> dict:
        """The case's parameters, as stored in the results' ``cases`` table."""
        return {
            "suite": self.suite,
            "dataset": self.dataset,
            "model": self.model,
            "width": self.width,
            "heads": self.heads,
            "in_features": self.in_features,
            "note": self.note,
        }


def _paper_cases() -> list[Case]:
    cases: list[Case] = []
    for dataset in _PAPER_DATASETS:
        small = dataset != "reddit"
        for hidden in _PAPER_HIDDEN:
            note = "Figure 5.11 (peak memory)" if hidden == 128 else "Table 5.2"
            quick = small or hidden in _QUICK_REDDIT_WIDTHS
            cases.append(Case(f"gcn-{dataset}-h{hidden}", "paper", dataset, "gcn", hidden, 1, quick, note))
        if small:
            cases.append(Case(f"gat-{dataset}-8x8", "paper", dataset, "gat", 8, 8, True, "GAT recipe (8 heads x 8)"))
        for hidden in _PAPER_HIDDEN:
            note = "Figure 5.11 (peak memory)" if hidden == 128 else "Table 5.2"
            quick = small or hidden in _QUICK_REDDIT_WIDTHS
            cases.append(Case(f"gat-{dataset}-1x{hidden}", "paper", dataset, "gat", hidden, 1, quick, note))
        if not small:
            cases.append(Case("gat-reddit-8x16", "paper", dataset, "gat", 16, 8, True, "8 heads on Reddit"))
        cases.extend(_library_cases(dataset))
        if dataset == "cora":  # CiteSeer: the published recipes, beside the other small graphs
            cases.append(Case("gcn-citeseer-h16", "paper", "citeseer", "gcn", 16, 1, True, "GCN recipe"))
            cases.append(Case("gat-citeseer-8x8", "paper", "citeseer", "gat", 8, 8, True, "GAT recipe (8 heads x 8)"))
        if dataset == "pubmed":  # the mid-size graph, between the small ones and Reddit-like
            cases.extend(_arxiv_cases())
    return cases


def _arxiv_cases() -> list[Case]:
    """The ogbn-arxiv-sized graph: the everyday mid-size benchmark of GNN papers."""
    note = "mid-size graph (ogbn-arxiv-sized)"
    shapes = [("gcn", 128, 1), ("gcn", 256, 1), ("sage", 128, 1), ("gin", 128, 1), ("gat", 8, 8),
              ("gat", 64, 1), ("gatv2", 16, 8)]
    return [Case(f"{model}-arxiv-{heads}x{width}" if model in ("gat", "gatv2") else f"{model}-arxiv-h{width}",
                 "paper", "arxiv", model, width, heads, True, note)
            for model, width, heads in shapes]


def _library_cases(dataset: str) -> list[Case]:
    """GraphSAGE, GIN and GATv2 (issue #14) on ``dataset``."""
    cases: list[Case] = []
    small = dataset != "reddit"
    shapes = [("sage", h, 1) for h in _LIBRARY_HIDDEN] + [("gin", h, 1) for h in _LIBRARY_HIDDEN]
    shapes += [("gatv2", 16, 1), ("gatv2", 16, 8)]
    for model, width, heads in shapes:
        name = f"{model}-{dataset}-{heads}x{width}" if model == "gatv2" else f"{model}-{dataset}-h{width}"
        quick = small or name in _QUICK_LIBRARY
        note = "layer library (issue #14)"
        cases.append(Case(name, "paper", dataset, model, width, heads, quick, note))
        if not small:
            cases.append(Case(f"{name}-in{NARROW_INPUT}", "paper", dataset, model, width, heads, quick,
                              note + f", first {NARROW_INPUT} input features", NARROW_INPUT))
    return cases


def _agg_cases() -> list[Case]:
    return [
        Case(f"agg-reddit-f{f}", "agg", "reddit", "spmm", f, 1, True, "GCN-normalised A @ x, forward + backward")
        for f in _AGG_FEATURES
    ]


def suite_cases(suite: str) -> list[Case]:
    """Every case of ``suite`` in run order (grouped by data set, small graphs first)."""
    if suite == "paper":
        return _paper_cases()
    if suite == "agg":
        return _agg_cases()
    raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")


def select_cases(suite: str, patterns: list[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases of ``suite`` whose name matches any glob in ``patterns`` (all when
    ``None`` or empty), restricted to the ``quick`` ones if asked. Order is kept."""
    cases = suite_cases(suite)
    if quick:
        cases = [c for c in cases if c.quick]
    if patterns:
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return cases
