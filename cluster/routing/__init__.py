"""Replica choice for a self-hosted backend: block hashes, the prefix index, cache-aware
affinity with bounded load, capacity-aware placement, and the routing view the gateway owns."""
