"""Prompt caching for the loopback servers, as each provider documents it (deterministic, in memory).

Anthropic (explicit): a ``cache_control`` breakpoint on a tool, a system block or a message block
asks to cache the prompt up to and including that block, in the API's order (tools, then system,
then messages). A request reads the longest prefix already cached, at any block position up to its
last breakpoint (so a conversation that moves its breakpoint forward still hits the turn before),
and writes the prefix up to its last breakpoint when that one is not cached yet. Prefixes shorter
than the model's minimum (1,024 tokens for Sonnet and Opus) are not cached, breakpoint or not. An
entry lives 5 minutes (``"ttl": "1h"``: an hour), refreshed by every read. Usage: ``input_tokens``
counts only what follows the last cached or written block.

OpenAI (automatic): a prompt of 1,024 tokens or more is cached; a later prompt reads the longest
prefix it shares with one seen before, reported in ``prompt_tokens_details.cached_tokens`` in steps
of 128 tokens from 1,024 on.

Tokens are the servers' own count (about 4 characters each), not a real tokenizer's.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

MIN_TOKENS = 1024
OPENAI_STEP = 128
TTL_S = {"5m": 300.0, "1h": 3600.0}


def _tokens(unit: Any) -> int:
    text = unit.get("text") if isinstance(unit, dict) and unit.get("type") == "text" else None
    return math.ceil(len(text if isinstance(text, str) else json.dumps(unit, sort_keys=True)) / 4)


def _units(body: dict[str, Any]) -> list[Any]:
    """The cacheable blocks of a Messages request in cache order: tools, system, message blocks."""
    units: list[Any] = list(body.get("tools") or [])
    system = body.get("system")
    units += [{"type": "text", "text": system}] if isinstance(system, str) and system else system or []
    for m in body.get("messages") or []:
        content = m.get("content")
        units += [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    return units


@dataclass
class CacheUse:
    read: int = 0
    written: int = 0


class AnthropicCache:
    def __init__(self, min_tokens: int = MIN_TOKENS) -> None:
        self.min_tokens = min_tokens
        self._entries: dict[str, float] = {}  # prefix hash -> expiry (monotonic)
        self._lock = threading.Lock()

    def use(self, body: dict[str, Any], now: float | None = None) -> CacheUse:
        now = time.monotonic() if now is None else now
        prefixes: list[tuple[str, int, dict[str, Any] | None]] = []  # (hash, tokens so far, cache_control)
        h, tokens = hashlib.sha256(), 0
        for unit in _units(body):
            h.update(json.dumps(unit, sort_keys=True).encode())
            tokens += _tokens(unit)
            cc = unit.get("cache_control") if isinstance(unit, dict) else None
            prefixes.append((h.hexdigest(), tokens, cc if isinstance(cc, dict) else None))
        marks = [i for i, p in enumerate(prefixes) if p[2] is not None]
        if not marks:
            return CacheUse()
        last = prefixes[marks[-1]]
        with self._lock:
            live = {p[0] for p in prefixes[: marks[-1] + 1] if self._entries.get(p[0], 0) > now}
            hit = next((p for p in reversed(prefixes[: marks[-1] + 1]) if p[0] in live), None)
            read = hit[1] if hit is not None else 0
            if hit is not None:
                self._entries[hit[0]] = max(self._entries[hit[0]], now + TTL_S["5m"])
            for key, n, cc in (prefixes[i] for i in marks):
                if n >= self.min_tokens and key not in live:
                    self._entries[key] = now + TTL_S.get(str((cc or {}).get("ttl", "5m")), TTL_S["5m"])
        written = last[1] - read if last[1] >= self.min_tokens and last[0] not in live else 0
        return CacheUse(read=read, written=written)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _shared(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class OpenAICache:
    def __init__(self, min_tokens: int = MIN_TOKENS, keep: int = 256) -> None:
        self.min_tokens = min_tokens
        self._seen: deque[str] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def use(self, prompt: str, prompt_tokens: int) -> int:
        """Cached tokens for a prompt (its canonical text); remembers it when long enough."""
        if prompt_tokens < self.min_tokens:
            return 0
        with self._lock:
            shared = max((_shared(prompt, s) for s in self._seen), default=0)
            self._seen.append(prompt)
        cached = min(shared // 4, prompt_tokens)
        return cached // OPENAI_STEP * OPENAI_STEP if cached >= self.min_tokens else 0

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
