"""Per-model token counting, one entry point for everyone: :func:`load` turns the ``tokenizer`` field
of :class:`cluster.config.ModelConfig` into a :class:`Tokenizer`, for the gateway (which tokenizes
once, with the target model's own tokenizer) and for the provider adapters (which count what the
router did not: budget reservations, estimates against reported usage) alike.

* a HF tokenizer folder (with its ``tokenizer_config.json``), a Hub id, or ``@tiny`` for the locally
  built model: :class:`HFTokenizer`, exact; chat requests are rendered with the model's own chat
  template, so the ids are what the engine will see, and a provider adapter counts the same;
* ``tiktoken:<encoding or model>``, ``estimate:<chars per token>``, a bare ``tokenizer.json``:
  the counters of :mod:`cluster.tokens.counters` (providers tokenize for themselves).

Tokenizers are cached per spec, and one HF tokenizer is shared by every caller: loading one costs
tens of milliseconds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from cluster.json_types import JSONObject
from cluster.tokens.counters import (
    ANTHROPIC_CHARS_PER_TOKEN,
    DEFAULT_ENCODING,
    OPENAI_CHARS_PER_TOKEN,
    CharEstimateTokenizer,
    ChatCounting,
    HFFileTokenizer,
    load_tiktoken,
)
from cluster.tokens.counters import content_text as content_text

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    exact: bool  # False: a count is an estimate (cost, TPM and context checks say so)
    name: str

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def chat_ids(self, messages: Sequence[JSONObject]) -> list[int]: ...

    def count_chat(self, messages: Sequence[JSONObject]) -> int: ...

    def render_chat(self, messages: Sequence[JSONObject]) -> str: ...


class HFTokenizer(ChatCounting):
    """A Hugging Face tokenizer with its chat template (self-hosted models, and open models behind a
    provider when their tokenizer folder is at hand)."""

    exact = True

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.name = f"hf:{Path(path).name}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[JSONObject]) -> str:
        return str(self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))

    def chat_ids(self, messages: Sequence[JSONObject]) -> list[int]:
        # The template already holds the BOS token: encoding the rendered text without special
        # tokens gives exactly the ids the engine would compute itself.
        return self.encode(self.render_chat(messages))

    def tool_chat_ids(
        self,
        messages: Sequence[JSONObject],
        tools: list[JSONObject] | None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The prompt with the tool definitions rendered by a tool-aware template (the model's own,
        or ``chat_template``): what the engine sees, so its count is the prompt's count."""
        text = self._tok.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.encode(str(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def resolve_model_path(path: str) -> str:
    if path == "@tiny":
        from cluster.engine.tiny_model import build

        return str(build())
    return path


@functools.lru_cache(maxsize=32)
def _hf(spec: str) -> HFTokenizer:
    return HFTokenizer(resolve_model_path(spec))


@functools.lru_cache(maxsize=32)
def load(spec: str, api: str | None = None) -> Tokenizer:
    """The tokenizer of a model's ``tokenizer`` spec. ``api`` is the provider's (``openai`` or
    ``anthropic``) when a provider adapter counts: then a spec that names no usable tokenizer is
    an estimate (with a warning) instead of an error, since the provider counts for itself."""
    if spec.startswith("tiktoken:"):
        return load_tiktoken(spec.split(":", 1)[1] or DEFAULT_ENCODING)
    if spec.startswith("estimate:"):
        return CharEstimateTokenizer(float(spec.split(":", 1)[1] or ANTHROPIC_CHARS_PER_TOKEN))
    p = Path(spec)
    if api is None or spec == "@tiny" or (p / "tokenizer_config.json").is_file():
        return _hf(spec)  # the router's and the adapter's counts agree: one template, one object
    if (p / "tokenizer.json").is_file() or (p.suffix == ".json" and p.is_file()):
        return HFFileTokenizer(spec)
    fallback = ANTHROPIC_CHARS_PER_TOKEN if api == "anthropic" else OPENAI_CHARS_PER_TOKEN
    log.warning("tokenizer %r cannot be used for a provider model; estimating %g chars/token", spec, fallback)
    return CharEstimateTokenizer(fallback)
