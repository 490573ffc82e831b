"""The connector's statistics and their Prometheus metrics."""
