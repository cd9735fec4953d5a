"""BENCHMARKS.md's and RESULTS.md's tables, rendered from the result files in loadtest/results/:
``python -m loadtest.tables.bench_tables`` (the pages' marked regions), one renderer module per group
of tables, and the formatting they share (table_format)."""
