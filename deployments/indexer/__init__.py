"""A cache-aware backend's KV indexers (``affinity.kv_index: indexer``, issue 42)."""
