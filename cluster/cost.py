"""What tokens cost: one formula for the gateway's per-request cost metric, the provider budget's
running total and the capacity planner's $/day. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ProviderConfig
from cluster.wire.protocol import Usage


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per million tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0
    cache_write: float | None = None  # None: cache writes cost the input price

    @classmethod
    def from_config(cls, cfg: ProviderConfig) -> Prices:
        return cls(
            cfg.cost_per_mtok_input,
            cfg.cost_per_mtok_cached_input,
            cfg.cost_per_mtok_output,
            cfg.cost_per_mtok_cache_write,
        )

    def usd(
        self, prompt_tokens: float, cached_tokens: float, completion_tokens: float, written: float = 0.0
    ) -> float:
        """The cost of a request (or of mean token counts, for the planner): cached prompt tokens at
        the cached price, ``written`` ones (a prompt-cache write) at the cache-write price, the rest
        of the prompt at the input price."""
        cached = min(cached_tokens, prompt_tokens)
        written = min(written, prompt_tokens - cached)
        write_price = self.input if self.cache_write is None else self.cache_write
        return (
            (prompt_tokens - cached - written) * self.input
            + cached * self.cached_input
            + written * write_price
            + completion_tokens * self.output
        ) / 1e6


def cost_usd(usage: Usage, prices: Prices) -> float:
    return prices.usd(
        usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, usage.cache_creation_tokens
    )
