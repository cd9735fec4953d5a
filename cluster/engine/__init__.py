"""The simulated engine (a vLLM-v1-like scheduler over a paged, prefix-cached KV cache), its
profiles, the KV-cache events every engine publishes, and the tiny local model."""
