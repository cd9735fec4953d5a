"""What tokens cost: one formula for the gateway's per-request cost metric, the provider budget's
running total and the capacity planner's $/day. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ProviderConfig
from cluster.protocol import Usage


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per million tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    @classmethod
    def from_config(cls, cfg: ProviderConfig) -> Prices:
        return cls(cfg.cost_per_mtok_input, cfg.cost_per_mtok_cached_input, cfg.cost_per_mtok_output)

    def usd(self, prompt_tokens: float, cached_tokens: float, completion_tokens: float) -> float:
        """The cost of a request (or of mean token counts, for the planner): cached prompt tokens at
        the cached price, the rest of the prompt at the input price."""
        cached = min(cached_tokens, prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + completion_tokens * self.output
        ) / 1e6


def cost_usd(usage: Usage, prices: Prices) -> float:
    return prices.usd(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
