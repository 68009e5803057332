"""The window-crossover sweep's pieces: the local graph generator and the crossover rule."""

from __future__ import annotations

import torch

from benchmarks.window_crossover import crossover, generate_local_graph


def test_local_graph_keeps_sources_in_the_block():
    graph = generate_local_graph(100, 5, 16, 1.0, seed=0, device=torch.device("cpu"))
    src, dst = graph.edge_index
    assert graph.num_edges == 500 and torch.equal(torch.bincount(dst, minlength=100), torch.full((100,), 5))
    assert torch.equal(src // 16, dst // 16)  # the last block (96..99) is partial: sources stay in it
    spread = generate_local_graph(100, 5, 16, 0.0, seed=0, device=torch.device("cpu"))
    assert bool((spread.edge_index[0] // 16 != spread.edge_index[1] // 16).any())


def test_crossover_is_the_lowest_density_of_an_unbroken_winning_run():
    rows = [{"tile_density": d, "window_over_gar": s} for d, s in
            [(0.06, 0.7), (0.2, 0.9), (0.2, 1.1), (0.4, 1.2), (0.4, 1.3), (0.8, 1.5), (0.8, 2.0)]]
    assert crossover(rows) == 0.4  # at 0.2 one width loses
    rows.append({"tile_density": 0.1, "window_over_gar": 1.4})  # a win below a loss does not count
    assert crossover(rows) == 0.4
    assert crossover([{"tile_density": 0.5, "window_over_gar": 0.9}]) is None
