"""fusegnn.attention is its own package on top of the GNN core: the core does not import
it, and the names fusegnn.sparse exported before the move still resolve to it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gnn_core_does_not_import_attention():
    """No module of fusegnn/sparse/ imports fusegnn.attention at import time (the
    compatibility names of fusegnn.sparse are resolved on first use)."""
    found = []
    for path in sorted((ROOT / "fusegnn" / "sparse").glob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [(path.name, n) for n in names if n.startswith("fusegnn.attention")]
    assert found == []


def test_former_sparse_names_resolve_to_the_attention_package():
    import fusegnn
    import fusegnn.attention as attention
    import fusegnn.sparse as sparse
    from fusegnn.sparse import BlockLayout, Mask, explain_attention, masks, sparse_attention

    assert fusegnn.attention is attention
    assert sparse_attention is attention.sparse_attention and explain_attention is attention.explain_attention
    assert Mask is attention.Mask and BlockLayout is attention.BlockLayout and masks is attention.masks
    assert Mask.__module__ == "fusegnn.attention.masks"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        sparse.not_a_name  # noqa: B018
