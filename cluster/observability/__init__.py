"""What the cluster tells about itself: request traces as plain data, Prometheus text read
without Prometheus, and the ``cluster status`` table."""
