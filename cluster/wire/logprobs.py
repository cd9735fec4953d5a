"""``logprobs`` on a self-hosted engine: what the request asks for, the engine's per-token logprobs
as OpenAI's shapes, and their framing across a stream's events. Pure.

An engine chunk carries one entry per sampled token in the chat shape (an item of
``choices[].logprobs.content``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``); a completion's
events get the legacy shape made from them (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{token: logprob}``, ``text_offset``). A token is the text it added to the answer (the engine
streams one token a step), so the tokens join to the text: a character that spans tokens is
written whole at its last token, the earlier ones are ``""``; ``bytes`` are that text's UTF-8.
A chunk of several tokens (rare) names each by its own decoding, as vLLM's server does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from cluster.json_types import JSON, JSONObject
from cluster.wire.errors import InvalidRequest

Entry = JSONObject
MAX_TOP = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit
FLOOR = -9999.0  # -inf as JSON can say it (vLLM's own server clamps the same way)


def asked(kind: str, logprobs: JSON, top_logprobs: int | None = None) -> int | None:
    """The engine's top-k count for a request (None: no logprobs), or a 400: chat takes
    ``logprobs: true`` with ``top_logprobs`` 0..20 (which needs it), completions an int 0..20."""
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest("logprobs: Input should be a valid boolean", param="logprobs")
        if top_logprobs is not None and not logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top_logprobs or 0) if logprobs else None
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP:
        raise InvalidRequest(f"logprobs: Input should be an integer from 0 to {MAX_TOP}", param="logprobs")
    return logprobs


def _lp(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else float(value)


def entry(token: str, logprob: float, top: Iterable[tuple[str, float]] = ()) -> Entry:
    """One token's item in the chat shape."""
    return {
        "token": token,
        "logprob": _lp(logprob),
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": _lp(v), "bytes": list(t.encode())} for t, v in top],
    }


def from_engine(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Any]],  # Any: vLLM's Logprob (its types are skipped)
    k: int,
    text: str | None = None,
) -> list[Entry]:
    """vLLM's per-token ``{token_id: Logprob(logprob, rank, decoded_token)}`` (the sampled token
    and the ``k`` most likely) as chat-shape entries, the top ones by rank. ``text``: what the
    chunk's tokens added to the answer; a chunk of one token names it so (its own decoding would
    not join to the text where a character spans tokens: the engine writes it whole, at its last)."""
    pairs = list(zip(token_ids, logprobs, strict=False))
    own = [_own(d.get(tid)) for tid, d in pairs]
    out = []
    for (tid, d), name in zip(pairs, names(own, text), strict=True):
        chosen = d.get(tid)
        top = sorted((p for p in d.values() if p.rank is not None and p.rank <= k), key=lambda p: p.rank)
        out.append(
            entry(
                name,
                chosen.logprob if chosen is not None else FLOOR,
                [(p.decoded_token or "", p.logprob) for p in top[:k]],
            )
        )
    return out


def _own(chosen: Any) -> str:  # Any: vLLM's Logprob
    return (chosen.decoded_token or "") if chosen is not None else ""


def names(own: list[str], text: str | None) -> list[str]:
    """Each token's string, joining to ``text`` (what the chunk added): its own decoding where the
    text goes on with it, else ``""``, the last token taking the rest. A replacement character the
    detokenizer wrote for bytes that never formed one (a random-weight model's output) lands there
    too, instead of being lost between tokens."""
    if text is None or not own or "".join(own) == text:
        return own
    out, pos = [], 0
    for tok in own[:-1]:
        if tok and text.startswith(tok, pos):
            out.append(tok)
            pos += len(tok)
        else:
            out.append("")
    out.append(text[pos:])
    return out


def prompt_shape(positions: Iterable[JSON]) -> list[dict[str, JSONObject] | None]:
    """vLLM's ``prompt_logprobs`` as its own server writes them: per prompt token ``None`` (the
    first: nothing before it) or ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the token
    itself and the top alternatives)."""
    return [
        None
        if d is None
        else {
            str(tid): {"logprob": _lp(p.logprob), "rank": p.rank, "decoded_token": p.decoded_token}
            for tid, p in d.items()
        }
        for d in positions
    ]


def with_prompt(body: JSONObject, prompt: list[JSON]) -> JSONObject:
    """A whole answer with the prompt's logprobs where vLLM's server puts them: chat at the top,
    completions on each choice."""
    if body.get("object") == "chat.completion":
        body["prompt_logprobs"] = prompt
    else:
        for c in body["choices"]:
            c["prompt_logprobs"] = prompt
    return body


def from_openai(lp: JSON) -> list[Entry] | None:
    """An OpenAI-compatible provider's ``choices[].logprobs`` (chat's ``content`` items as they
    are, or the completions shape) as entries; None when it sent none or a shape we do not know."""
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        return [e for e in lp["content"] if isinstance(e, dict)]
    tokens, values, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = tops if isinstance(tops, list) else []
    out = []
    for i, (tok, value) in enumerate(zip(tokens, values, strict=False)):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append(entry(str(tok), value if isinstance(value, int | float) else FLOOR, top.items()))
    return out


def completion_shape(entries: list[Entry], offset: int = 0) -> JSONObject:
    """The legacy completions shape; ``offset``: the text's length before these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def shape(kind: str, entries: list[Entry], offset: int = 0) -> JSONObject:
    """A choice's ``logprobs`` for these entries in the route's shape."""
    if kind == "chat":
        return {"content": entries, "refusal": None}
    return completion_shape(entries, offset)


class LogprobsFraming:
    """A stream's entries onto its events: those of chunks that sent no event yet ride on the next
    one (as their token ids do); with ``collect`` every entry is kept for the whole answer."""

    __slots__ = ("kept", "kind", "offset", "pending")

    def __init__(self, kind: str, collect: bool) -> None:
        self.kind = kind
        self.pending: list[Entry] = []
        self.kept: list[Entry] | None = [] if collect else None
        self.offset = 0

    def add(self, entries: list[Entry] | None) -> None:
        if entries:
            self.pending.extend(entries)
            if self.kept is not None:
                self.kept.extend(entries)

    def take(self) -> JSONObject | None:
        """The pending entries as the next event's ``logprobs`` (None: none pending)."""
        if not self.pending:
            return None
        out = shape(self.kind, self.pending, self.offset)
        self.offset += sum(len(e["token"]) for e in self.pending)
        self.pending = []
        return out

    def whole(self) -> JSONObject | None:
        """The whole answer's ``logprobs`` (collecting, and some were produced)."""
        return shape(self.kind, self.kept) if self.kept else None
