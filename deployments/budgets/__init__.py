"""The shared budgets: one Serve deployment that holds the counts, and its clients for tenants and
provider backends (or a local budget per process when nothing is shared)."""
