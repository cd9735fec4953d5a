"""What the load tests, benchmarks and the reliability tier share: the clients and their statistics,
request shapes and workloads, the processes a benchmark starts (fake upstream, serve floor, peers,
the real engine in process), the look inside Ray's actors, and each result file's provenance."""
