"""The benchmarks: each runnable as ``python -m loadtest.benchmarks.<name>`` (``bench_all`` runs those
that write a result file in loadtest/results/, ``cli_bench`` is ``cluster bench``), with the helpers
only one benchmark uses beside it (hedge_bound, planner_real, rehearsal_*)."""
