"""One request of a load test: what to send, for which session and surface, when, and when the client
gives up. The surfaces' sessions (``loadtest/common/surfaces.py``), the shared-prefix workloads
(``loadtest/common/workloads.py``), the trace files and every runner use this one type.

Its record (:meth:`RequestSpec.to_record`) is a plain dict, a line of a JSONL trace
(:mod:`loadtest.common.arrivals`): the arrival offset is ``t`` there, as in every trace, and fields that
are None (and an empty ``group``) are left out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]


@dataclass(slots=True, kw_only=True)
class RequestSpec:
    """One request of a workload: when to send it, for which session, and what to send."""

    session_id: str
    max_tokens: int
    surface: str | None = None  # the product surface (x-surface); None: the server's default
    tenant: str | None = None  # who pays (x-tenant, without auth); None: no tenant
    kind: Kind = "chat"
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | None = None  # completion
    arrival_s: float = 0.0  # offset from the start of an open-loop schedule
    turn: int = 0  # 0 for a session's first request
    group: str = ""  # the shared-prefix group (customer, repository) a session belongs to
    cancel_after_s: float | None = None  # the client gives up this long after sending
    prompt_tokens_est: int = 0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "ignore_eos": True}
        if self.kind == "chat":
            b["messages"] = self.messages
        else:
            b["prompt"] = self.prompt
        if stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        return b

    def headers(self) -> dict[str, str]:
        h = {"x-session-id": self.session_id}
        if self.surface is not None:
            h = {"x-surface": self.surface, **h}
        if self.tenant is not None:
            h["x-tenant"] = self.tenant
        return h

    def to_record(self) -> dict[str, Any]:
        rec = {k: v for k, v in asdict(self).items() if v is not None and not (k == "group" and v == "")}
        rec["t"] = rec.pop("arrival_s")
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> RequestSpec:
        """A spec from a record (a trace line, or :meth:`to_record`'s dict); unknown keys are ignored."""
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in rec.items() if k in known}
        if "t" in rec:
            fields["arrival_s"] = float(rec["t"])
        if fields.get("messages") is not None:
            fields["messages"] = [dict(m) for m in fields["messages"]]
        spec = cls(**fields)
        if spec.kind not in ("chat", "completion"):
            raise ValueError(f"record kind must be chat or completion, got {spec.kind!r}")
        if (spec.kind == "chat") != (spec.messages is not None) or (
            spec.kind == "completion" and spec.prompt is None
        ):
            raise ValueError("a chat record needs 'messages', a completion record needs 'prompt'")
        return spec
