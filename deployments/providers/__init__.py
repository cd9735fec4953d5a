"""The provider adapters (OpenAI-compatible, Anthropic Messages) that run inside the gateway: the
adapters, their HTTP side, a stream's reads as chunks and their counts."""
