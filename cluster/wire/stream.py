"""The one seam every backend's stream plugs into on the gateway's side.

An attempt's stream (:class:`AttemptStream`) yields the client's SSE bytes, whatever the backend:
an engine replica's (vLLM or the simulator, over HTTP: ``deployments/gateway/engine_client.py``) pass
through as read; a provider adapter's typed chunks are framed into them on the way
(:class:`cluster.wire.framing.FramedStream`). Once it is over, :meth:`TokenStream.ending` says how
it ended in one shape (:class:`Ending`) for both. The race (:mod:`cluster.policy.race`) runs such
streams, the relay (``deployments/gateway/relay.py``) reads them as :class:`TokenStream`, and a broken
engine stream is continued elsewhere from what it :meth:`AttemptStream.emitted`
(``deployments/gateway/migration.py``, which is itself a :class:`TokenStream`).

Pure: no I/O here, only the shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Literal, Protocol

from cluster.json_types import JSON, JSONObject
from cluster.wire.engine_stream import Emitted, StreamEnd
from cluster.wire.protocol import Usage

# Why an engine stream broke: its replica died or the connection did, it drained, or it sent an error
Fault = Literal["death", "drain", "error"]


@dataclass(frozen=True, slots=True)
class Ending:
    """How a stream ended: what the relay accounts for, and what a collecting client is answered."""

    finish_reason: str = "stop"
    usage: Usage | None = None  # as the backend reported it (None: it reported none)
    text: str = ""  # the whole text (collecting)
    tool_calls: list[JSONObject] | None = None
    thinking: list[JSONObject] | None = None  # a provider's thinking blocks
    logprobs: JSONObject | None = None
    choices: list[JSONObject] | None = None  # n > 1: each choice (cluster.wire.choices)
    prompt_logprobs: list[JSON] | None = None  # vLLM's, when asked for


def ending_of(end: StreamEnd) -> Ending:
    """An engine's end frame as the one :class:`Ending`."""
    return Ending(
        end.finish_reason,
        end.usage,
        end.text or "",
        end.tool_calls or None,
        None,
        end.logprobs,
        end.choices,
        end.prompt_logprobs,
    )


class TokenStream(Protocol):
    """A stream as the relay reads it while and after relaying it."""

    @property
    def replica(self) -> str | None:
        """The replica serving it (None: not chosen yet, or a provider's)."""
        ...

    @property
    def events(self) -> int:
        """Content events relayed so far (an engine's SSE events, a provider's content chunks)."""
        ...

    @property
    def finish_held(self) -> bool:
        """The last item carried the finish event: the relay holds it back to leave with the
        stream's tail (usage, ``[DONE]``) in one write."""
        ...

    def ending(self) -> Ending | None:
        """How it ended; None while it runs, or when it broke before saying (an engine's end frame)."""
        ...


class AttemptStream(TokenStream, Protocol):
    """One attempt on one backend, as the race runs it: an async iterator of the client's SSE
    bytes. Closing it aborts the work upstream (the engine request, the provider's HTTP stream)."""

    @property
    def fault(self) -> Fault | None:
        """What broke it (None: not broken, or not an engine's)."""
        ...

    @property
    def placed_at(self) -> float | None:
        """When (monotonic) its engine replica was chosen: from then on the engine had it (None: a
        provider's, or no replica yet)."""
        ...

    def emitted(self) -> Emitted | None:
        """What it sent, token ids included, when it names them (an engine asked for ids, so that a
        break can be continued elsewhere); None: it cannot be continued."""
        ...

    def won(self) -> None:
        """Its first token won the race: its replica stops counting its prompt as prefilling."""
        ...

    def finished(self) -> None:
        """Its request is over: its replica stops counting it in flight."""
        ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def __anext__(self) -> Awaitable[bytes]: ...

    async def aclose(self) -> None: ...
