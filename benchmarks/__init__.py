"""The fusegnn benchmark harness.

One entry point, run from the repository root::

    python -m benchmarks.run --suite paper      # 2-layer GCN / GAT training steps (fuseGNN Table 5.2)
    python -m benchmarks.run --suite agg        # SpMM forward / backward on Reddit-like
    python -m benchmarks.run --suite attention  # masked attention against FlexAttention and SDPA
    python -m benchmarks.run --suite attention --sweep calibrate   # a tuning sweep (--list names them)

Modules, one concept each:

* :mod:`benchmarks.cases` -- the case grids of the two suites and their names;
* :mod:`benchmarks.data` -- the data sets the cases run on (Planetoid, Reddit-like);
* :mod:`benchmarks.models` -- the 2-layer GCN / GAT, as fusegnn and as PyG models;
* :mod:`benchmarks.backends` -- what each backend name means and whether it can run;
* :mod:`benchmarks.measure` -- timing (CUDA events), peak memory, kernel launches;
* :mod:`benchmarks.runner` -- one case: check every backend's output, then time it;
* :mod:`benchmarks.report` -- JSON (written incrementally), markdown table, PNG chart;
* :mod:`benchmarks.attention` -- the ``attention`` suite (cases, backends, runner);
* :mod:`benchmarks.graphs` -- capture of a step into a CUDA graph (``*-graphed`` attention rows);
* :mod:`benchmarks.sweeps` -- the ``--sweep`` modes (``attention_calibrate``,
  ``attention_kernels_gpu``, ``kernels_spmm_gpu``);
* :mod:`benchmarks.run` -- the command line.

``benchmarks/README.md`` says how to run it and what each column means.
"""
