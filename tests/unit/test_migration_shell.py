"""The gateway's migration shell (deployments/gateway/migration.py) over fake engine streams: what the
relay gets when a stream breaks after its first token. The integration tests kill real replicas;
these cover the paths a kill rarely hits: the last token already sent, a refusal, no replica for
the continuation, the non-streaming client's text."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from typing import Any

import pytest

from cluster.config import parse_config
from cluster.policy.failover import PlannedAttempt
from cluster.policy.migration import DRAINING_CODE, MigrationConfig, MigrationPolicy
from cluster.policy.race import Attempt, RaceHooks, RaceResult, follow
from cluster.wire.engine_stream import Emitted, StreamEnd, event_with_ids, parse_control, parse_emitted
from cluster.wire.errors import BackendUnavailable, StreamInterrupted
from cluster.wire.openai_format import ResponseMeta, sse, stream_chunk
from cluster.wire.protocol import ChatCompletionRequest, Chunk, GenerateRequest, Sampling, Usage
from cluster.wire.stream import Ending, Fault, ending_of
from deployments.gateway.context import RequestContext
from deployments.gateway.migration import Migrations, Seamless
from deployments.gateway.prepare import Prepared

META = ResponseMeta(kind="chat", request_id="r", model="m", created=1)
CFG = parse_config(
    {
        "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 4096}],
        "backends": [{"name": "a", "kind": "sim", "model": "m", "replicas": 2}],
        "surfaces": [{"name": "chat"}],
    }
)


def ev(text: str, ids: list[int], finish: str | None = None, first: bool = False) -> bytes:
    return event_with_ids(sse(stream_chunk(META, text, finish, first)), ids)


class FakeStream:
    """An engine attempt (a cluster.wire.stream.AttemptStream): its events, then a break
    (``fail``) or an end frame (``end``)."""

    def __init__(self, items: list[bytes], replica: str, end: StreamEnd | None = None) -> None:
        self.items, self.replica, self._final = list(items), replica, end
        self.passed: list[bytes] = []
        self.fault: Fault | None = None
        self.events = 0
        self.finish_held = False
        self.end: StreamEnd | None = None

    def ending(self) -> Ending | None:
        return ending_of(self.end) if self.end is not None else None

    def emitted(self) -> Emitted:
        return parse_emitted(self.passed)

    def won(self) -> None:
        pass

    def finished(self) -> None:
        pass

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> bytes:
        if self.items and self.items[0] == b"stall":
            await asyncio.sleep(3600)  # silent until the watchdog ends it
        if self.items:
            item = self.items.pop(0)
            self.passed.append(item)
            self.events += 1
            return item
        if self._final is None:
            self.fault = "death"
            raise StreamInterrupted("the stream broke after it started: connection lost")
        self.end = self._final
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


class FakeAttempts:
    """``gw.attempts`` for the shell: the policy, the counters, and hooks whose one attempt is the
    next of ``streams`` (none left: no replica takes the continuation)."""

    def __init__(self, streams: list[FakeStream], config: MigrationConfig | None = None) -> None:
        self.streams = streams
        self.migration = MigrationPolicy(config)
        self.migrated: Counter[str] = Counter()
        self.continuations: list[tuple[GenerateRequest, Any]] = []

    def hooks(self, req: GenerateRequest, candidates: list[str], *args: Any) -> tuple[RaceHooks, None]:
        self.continuations.append((req, args[-1]))
        left = [PlannedAttempt(candidates[0], 0)]

        def start(planned: PlannedAttempt, hedge: bool, prior: list[Attempt]) -> Any:
            if not self.streams:
                raise BackendUnavailable("no replica")
            return self.streams.pop(0)

        return RaceHooks(
            next_attempt=lambda hedge: left.pop() if left else None, start=start, cancel=_noop
        ), None


async def _noop(_stream: Any) -> None:
    pass


def _seam(
    first: FakeStream, more: list[FakeStream], stream: bool = True, idle: float | None = None, **cfg: Any
) -> Seamless:
    req = GenerateRequest("r", "m", "chat", [1, 2, 3], Sampling(max_tokens=4))
    api = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=stream)
    prepared = Prepared(api, req, META, ["a"], lambda _backend: [])
    ctx = RequestContext(prepared, ["a"], 0.0, 0.0)
    attempts: Any = FakeAttempts(more, MigrationConfig(**cfg) if cfg else None)
    parts = Migrations(attempts, {}, CFG.backend, idle)
    hooks = RaceHooks(next_attempt=lambda hedge: None, start=lambda *a: first, cancel=_noop)
    winner = Attempt(PlannedAttempt("a", 0), False, first, 0.0)
    result = RaceResult(winner, [winner])
    return Seamless(parts, ctx, result, winner, follow(hooks, winner, None, idle), None, lambda: 0.0)


async def _drain(seam: Seamless) -> list[bytes]:
    return [item async for item in seam.items()]


async def test_a_break_continues_on_another_replica_and_the_client_gets_one_answer() -> None:
    broken = FakeStream([ev("a", [7], first=True), ev("b", [8])], "r1")
    end = StreamEnd("length", Usage(5, 2, 4), "cd", "r2")
    cont = FakeStream([ev("c", [9]), ev("d", [10], "length")], "r2", end)
    seam = _seam(broken, [cont], stream=False)
    items = await _drain(seam)
    assert len(items) == 4 and seam.migrations == 1 and seam.replica == "r2"
    req, continuing = seam.parts.attempts.continuations[0]
    assert req.prompt_token_ids == [1, 2, 3, 7, 8] and req.sampling.max_tokens == 2 and req.attempt == 1
    assert continuing.attempt_base == 1 and continuing.avoid == ("r1",)
    final = seam.ending()
    assert final is not None and final.text == "abcd" and final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (3, 4, 3)
    assert seam.events == 4 and seam.parts.attempts.migrated == {"death:migrated": 1}


async def test_a_break_after_the_last_token_ends_the_answer_without_a_continuation() -> None:
    broken = FakeStream([ev("a", [7], first=True), ev("b", [8], "stop")], "r1")  # the end frame lost
    seam = _seam(broken, [])
    assert len(await _drain(seam)) == 2
    final = seam.ending()
    assert final is not None and final.finish_reason == "stop" and final.text == "ab"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 2)
    assert seam.parts.attempts.continuations == [] and seam.migrations == 0


@pytest.mark.parametrize(("cfg", "outcome"), [({"enabled": False}, "disabled"), ({}, "failed")])
async def test_refused_or_unplaced_the_break_stays_a_clean_error(cfg: dict[str, Any], outcome: str) -> None:
    broken = FakeStream([ev("a", [7], first=True)], "r1")
    seam = _seam(broken, [], **cfg)  # no stream left: the continuation finds no replica
    got: list[bytes] = []
    with pytest.raises(StreamInterrupted, match="connection lost"):
        async for item in seam.items():
            got.append(item)
    assert len(got) == 1 and seam.parts.attempts.migrated == {f"death:{outcome}": 1}


async def test_a_stream_silent_past_the_idle_timeout_migrates_as_a_stall() -> None:
    stalled = FakeStream([ev("a", [7], first=True), b"stall"], "r1")
    cont = FakeStream([ev("b", [8], "length")], "r2", StreamEnd("length", Usage(4, 1), None, "r2"))
    seam = _seam(stalled, [cont], idle=0.05)
    assert len(await _drain(seam)) == 2
    assert seam.parts.attempts.migrated == {"stall:migrated": 1} and stalled.fault is None


async def test_at_most_max_per_request_migrations() -> None:
    streams = [FakeStream([ev("x", [20 + i])], f"r{i + 2}") for i in range(3)]
    seam = _seam(FakeStream([ev("a", [7], first=True)], "r1"), streams, max_per_request=2)
    with pytest.raises(StreamInterrupted):
        await _drain(seam)
    assert seam.migrations == 2 and seam.parts.attempts.migrated == {
        "death:migrated": 2,
        "death:max_per_request": 1,
    }
    _, (req2, c2) = seam.parts.attempts.continuations
    assert req2.prompt_token_ids == [1, 2, 3, 7, 20] and c2.avoid == ("r1", "r2")


# --- the engine's side: token ids in the events, a continued stream, a drain -------------------


class _Resp:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


async def _engine_relay(
    chunks: list[Chunk],
    flags: tuple[bool, bool, bool],
    draining: bool = False,
    tool_parse: dict[str, Any] | None = None,
) -> list[bytes]:
    from deployments.engine.engine import EngineReplica

    # Its methods without Serve or a server (and without the async destructor, which has nothing to stop)
    bare = type("BareEngineReplica", (EngineReplica.func_or_class,), {"__del__": lambda self: None})
    replica = object.__new__(bare)
    replica.replica_id, replica.draining = "e1", draining

    async def gen() -> Any:
        for c in chunks[1:]:
            yield c

    resp = _Resp()
    await replica._relay(resp, gen(), chunks[0], META, flags, tool_parse)
    return resp.writes


async def test_the_engine_names_each_events_token_ids_and_a_continued_stream_has_no_role() -> None:
    chunks = [Chunk("a", [1]), Chunk("", [2]), Chunk("b", [3]), Chunk("c", [4], "length", Usage(3, 4))]
    plain = await _engine_relay(chunks, (False, False, False))
    assert not any(b": ids" in w for w in plain) and b'"role"' in plain[0]
    writes = await _engine_relay(chunks, (False, True, True))
    got = parse_emitted(writes[:-1])
    assert got.ids == [1, 2, 3, 4] and got.text == ["a", "b", "c"]  # an id without text rides along
    assert not any(b'"role"' in w for w in writes) and writes[-1].startswith(b": llmc end ")


async def test_a_draining_engine_ends_its_aborted_streams_with_a_drain_error() -> None:
    chunks = [Chunk("a", [1]), Chunk("", [], "abort")]  # what the sim's shutdown gives a stream
    last = parse_control((await _engine_relay(chunks, (False, True, False), draining=True))[-1].rstrip(b"\n"))
    assert last.error is not None and last.error.code == DRAINING_CODE
    last = parse_control((await _engine_relay(chunks, (False, True, False)))[-1].rstrip(b"\n"))
    assert last.error is None and last.finish_reason == "abort"  # an abort that is no drain: as before


async def test_the_engine_turns_a_tool_parsers_text_into_tool_calls_with_their_ids_and_end_frame() -> None:
    """A named function's arguments, cut across chunks: tool_calls deltas (the token ids still
    ride along), the finish reason tool_calls, and the whole call in the collected end frame."""
    chunks = [Chunk('{"unit":', [1]), Chunk("", [2]), Chunk('"c"}', [3], "stop", Usage(3, 3))]
    writes = await _engine_relay(chunks, (True, True, False), tool_parse={"mode": "named", "name": "f"})
    events = [json.loads(line[6:]) for w in writes for line in w.split(b"\n") if line.startswith(b"data: ")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[0]["tool_calls"][0]["function"]["name"] == "f"
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d)
    assert args == '{"unit":"c"}' and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert parse_emitted(writes[:-1]).ids == [1, 2, 3]
    end = parse_control(writes[-1].rstrip(b"\n"))
    assert end.finish_reason == "tool_calls" and end.text == ""
    assert end.tool_calls is not None and end.tool_calls[0]["function"] == {
        "name": "f",
        "arguments": '{"unit":"c"}',
    }


def test_a_continuation_races_over_the_models_own_engines_only() -> None:
    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 4096}],
            "backends": [
                {"name": "a", "kind": "sim", "model": "m"},
                {
                    "name": "p",
                    "kind": "provider",
                    "model": "m",
                    "provider": {"api": "openai", "base_url": "http://x"},
                },
                {"name": "b", "kind": "sim", "model": "m"},
            ],
            "surfaces": [{"name": "chat"}],
            "routes": [{"model": "m", "candidates": ["a", "p", "b"]}],
        }
    )
    seam = _seam(FakeStream([ev("a", [7], first=True)], "r1"), [])
    seam.parts = Migrations(seam.parts.attempts, {}, cfg.backend, None)
    seam.p = dataclasses.replace(seam.p, candidates=["p", "b", "a"])
    assert seam._candidates() == ["a", "b"]  # the broken backend first; never a provider
