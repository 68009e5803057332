"""The GCN and GAT models under ``torch.compile(mode="reduce-overhead")`` (CUDA graph
trees) and ``"max-autotune-no-cudagraphs"``, trained next to an eager twin: the graph's
caches (normalised graph, formats, plans) are built outside the CUDA-graph memory pool
(:func:`fusegnn.sparse.graph.outside_graph_pools`), so replays never overwrite them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusegnn import Graph
from fusegnn.models import GAT, GCN
from tests.graphs import random_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_compiled_model_trains_like_eager(mode, kind):
    torch._dynamo.reset()
    n = 300
    graph = Graph(random_graph(n, 2400, 5, hub_degree=120).cuda(), n)
    x = torch.randn(n, 24, device="cuda")
    y = torch.randint(0, 4, (n,), device="cuda")

    def make():
        torch.manual_seed(0)
        if kind == "gcn":
            return GCN(24, 16, 4, dropout=0.0).cuda()
        return GAT(24, 8, 4, heads=4, dropout=0.0).cuda()

    eager, model = make(), make()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    opt_e = torch.optim.Adam(eager.parameters(), lr=0.01)
    opt_c = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(6):
        for net, opt, is_compiled in ((eager, opt_e, False), (compiled, opt_c, True)):
            opt.zero_grad(set_to_none=True)
            if is_compiled:
                torch.compiler.cudagraph_mark_step_begin()
            loss = F.cross_entropy(net(x, graph), y)
            loss.backward()
            opt.step()
            if is_compiled:
                compiled_loss = float(loss)
            else:
                eager_loss = float(loss)
        assert abs(compiled_loss - eager_loss) <= 1e-4 * max(1.0, abs(eager_loss))
