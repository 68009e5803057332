"""The fusegnn benchmark harness.

One entry point, run from the repository root::

    python -m benchmarks.run --suite paper      # 2-layer GCN / GAT training steps (fuseGNN Table 5.2)
    python -m benchmarks.run --suite agg        # SpMM forward / backward on Reddit-like

Modules, one concept each:

* :mod:`benchmarks.cases` -- the case grids of the two suites and their names;
* :mod:`benchmarks.data` -- the data sets the cases run on (Planetoid, Reddit-like);
* :mod:`benchmarks.models` -- the 2-layer GCN / GAT, as fusegnn and as PyG models;
* :mod:`benchmarks.backends` -- what each backend name means and whether it can run;
* :mod:`benchmarks.measure` -- timing (CUDA events), peak memory, kernel launches;
* :mod:`benchmarks.runner` -- one case: check every backend's output, then time it;
* :mod:`benchmarks.report` -- JSON (written incrementally), markdown table, PNG chart;
* :mod:`benchmarks.run` -- the command line.

``benchmarks/README.md`` says how to run it and what each column means.
"""
