"""Per-model token counting: the router tokenizes once, with the target model's own tokenizer.

``load_tokenizer(spec)`` understands the ``tokenizer`` field of :class:`cluster.config.ModelConfig`:

* a HF tokenizer folder, or ``@tiny`` for the locally built model — exact; chat requests are
  rendered with the model's own chat template, so the ids are what the engine will see;
* ``tiktoken:<encoding or model>`` and ``estimate:<chars per token>`` — provider models, handled
  by :mod:`cluster.tokens_provider` (counts only: the provider tokenizes for itself).

Tokenizers are cached per spec: loading one costs tens of milliseconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    exact: bool  # False: a count is an estimate (cost, TPM and context checks say so)

    def encode(self, text: str) -> list[int]: ...

    def chat_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str: ...


class HFTokenizer:
    """A Hugging Face tokenizer with its chat template (self-hosted models)."""

    exact = True

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.eos_token_id: int | None = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        return str(self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))

    def chat_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        # The template already holds the BOS token: encoding the rendered text without special
        # tokens gives exactly the ids the engine would compute itself.
        return self.encode(self.render_chat(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


class EstimateTokenizer:
    """A documented estimate: ceil(characters / chars_per_token). Ids are placeholders."""

    exact = False

    def __init__(self, chars_per_token: float = 3.5) -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self.chars_per_token = chars_per_token

    def encode(self, text: str) -> list[int]:
        return [0] * math.ceil(len(text) / self.chars_per_token)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        return "".join(f"{m.get('role', '')}: {content_text(m.get('content'))}\n" for m in messages)

    def chat_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        # 4 tokens of framing per message, as chat formats spend on role markers.
        n = sum(4 + len(self.encode(content_text(m.get("content")))) for m in messages)
        return [0] * n


def content_text(content: Any) -> str:
    """The text of an OpenAI message content: a string or a list of parts (non-text parts dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


def resolve_model_path(path: str) -> str:
    if path == "@tiny":
        from cluster.tiny_model import build

        return str(build())
    return path


@functools.lru_cache(maxsize=32)
def load_tokenizer(spec: str) -> Tokenizer:
    if spec.startswith("estimate:"):
        return EstimateTokenizer(float(spec.split(":", 1)[1] or 3.5))
    if spec.startswith("tiktoken:"):
        from cluster.tokens_provider import load_tiktoken

        return load_tiktoken(spec.split(":", 1)[1])
    return HFTokenizer(resolve_model_path(spec))
