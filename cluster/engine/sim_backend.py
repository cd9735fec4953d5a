"""A simulated replica in real time: :class:`SimBackend` is an engine backend
(:class:`cluster.wire.backend.EngineBackend`) on top of the virtual-clock
:class:`cluster.engine.model.EngineModel`.

One asyncio task drives the engine: it runs a step, sleeps the step's duration (divided by
``speedup``), then hands the step's tokens to the waiting streams. It starts with the first
request and ends when the engine is idle. The engine's clock is virtual time, tied to the event
loop's clock: ``virtual = v0 + (loop.time() - r0) * speedup``. A step's bookkeeping (blocks freed,
requests finished) happens when it starts; its tokens reach the streams when it ends.

Each output token is one :class:`Chunk` whose text is a fake word for its token id; the last one
carries ``finish_reason`` ("length", or "stop" when ``eos_probability`` drew an earlier end) and
:class:`Usage`. Sampling is seeded and positional (:func:`cluster.engine.model.seeded_token_id`,
and the end drawn per absolute position): a request continued on another replica with its prompt
plus the tokens already emitted, the remaining ``max_tokens`` and the same seed produces exactly
the tokens the uninterrupted run would have. Without a seed in the request, the seed is taken from
its request id (the same for every attempt). Streams are keyed by attempt
(``GenerateRequest.route_key``): a retry, hedge or continuation may reach the same replica.
Cancelling the consuming task or closing the iterator aborts the request in the engine (its
blocks are freed); ``abort(request_id)`` ends its streams with ``finish_reason="abort"``.

Fault knobs (:class:`SimOptions`, all off by default) reproduce what the router must survive:
a share of requests delayed before the first token, an error rate (``BackendUnavailable`` before
the first token), a stall after N tokens (the stream goes silent until aborted or cancelled), and
a dead replica (every call raises ``BackendUnavailable``). Request deadlines are not enforced here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import zlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config import BackendConfig, ModelConfig
from cluster.engine.kv import salt_keys
from cluster.engine.kv_events import KVEventLog
from cluster.engine.model import EngineModel, SimRequest, TokenEvent, fake_token_id
from cluster.engine.profiles import Profile, get_profile
from cluster.engine.request_queue import SchedulingPolicy
from cluster.engine.sim_options import SimOptions
from cluster.json_types import JSONObject
from cluster.wire.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    InvalidRequest,
    StreamInterrupted,
)
from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest, Usage

DEFAULT_PROFILE = "cpu-tiny"


_ABORT = object()  # stream sentinel: aborted through abort()


@dataclass(eq=False)
class _Stream:
    req: SimRequest
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)  # Any: token events or _ABORT


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "do", "fe", "gi", "ho", "ju")


def fake_word(token_id: int) -> str:
    """A deterministic pronounceable word for a token id (distinct ids, distinct words)."""
    n = len(_SYLLABLES)
    parts = [_SYLLABLES[token_id % n]]
    token_id //= n
    while token_id:
        parts.append(_SYLLABLES[token_id % n])
        token_id //= n
    return " " + "".join(parts)


def eos_after(seed: int, start: int, max_tokens: int, p: float) -> int | None:
    """How many tokens a request whose output starts at absolute position ``start`` samples before
    its end (the first position whose seeded draw is under ``p``: geometric lengths), or None when
    that is not before ``max_tokens``. A continuation (a later ``start``, fewer ``max_tokens``)
    finds the same end position the uninterrupted request had."""
    for k in range(max_tokens - 1):
        if fake_token_id(seed ^ _EOS_SALT, start + k, 1 << 32) < p * (1 << 32):
            return k + 1
    return None


_EOS_SALT = 0x5EED_E05


def served_vocab(model: ModelConfig | None) -> int | None:
    """The vocabulary size of the model a sim replica serves, from its weights' ``config.json``
    (``@tiny``: the local model's), or None when it has no weights at hand. The sim draws its fake
    token ids below it: a stream continued on a real engine of that model after the sim's replica
    died (mid-stream migration) feeds those ids back as its prompt, which an 8B profile's ids past
    the model's vocabulary would make the engine refuse."""
    if model is None or model.path is None:
        return None
    if model.path == "@tiny":
        from cluster.engine.tiny_model import VOCAB

        return VOCAB
    with contextlib.suppress(OSError, ValueError, TypeError):
        vocab = json.loads((Path(model.path) / "config.json").read_text()).get("vocab_size")
        return int(vocab) if vocab else None
    return None


class SimBackend:
    """A simulated engine replica behind the EngineBackend protocol."""

    def __init__(
        self,
        profile: Profile,
        *,
        options: SimOptions | JSONObject | None = None,
        replica: str = "sim-0",
        backend: str = "sim",
        enable_prefix_caching: bool = True,
        scheduling_policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.options = (
            options if isinstance(options, SimOptions) else SimOptions.model_validate(options or {})
        )
        self.kv_events = KVEventLog()  # vLLM's KV events, served to the gateways (cluster.engine.kv_events)
        self.engine = EngineModel(
            profile,
            enable_prefix_caching=enable_prefix_caching,
            keep_finished=False,
            scheduling_policy=scheduling_policy,
            on_kv_events=lambda events, _end: self.kv_events.append(events, time.time()),
        )
        self.replica = replica
        self.backend = backend
        # The fault draws: seeded per replica, so replicas of one backend draw independently (with
        # one shared sequence, a hedge to another replica of a slow call was slow too: bench_hedging
        # run 3 lost 9 of its 46 hedges to their slow primaries that way).
        seed = self.options.seed
        self._rng = random.Random(None if seed is None else f"{seed}/{replica}")
        self._streams: dict[str, _Stream] = {}
        self._driver: asyncio.Task[None] | None = None
        self._anchor: tuple[float, float] | None = None  # (loop time, virtual time)
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        # the extra_latency_* fault: requests it delayed, and those cancelled while delayed (never
        # started on the engine, so in no other counter)
        self.extra_latency_requests = 0
        self.extra_latency_cancelled = 0

    @classmethod
    def from_config(
        cls, backend: BackendConfig, model: ModelConfig | None = None, replica: str | None = None
    ) -> SimBackend:
        """Profile ``backend.sim_profile`` (default cpu-tiny) with the backend's engine arguments that
        are set laid over it (block_size, max_num_seqs, max_model_len, kv_cache_memory_bytes,
        gpu_memory_utilization, a tensor_parallel_size other than 1, max_num_batched_tokens), the
        engine's scheduling policy, the model's context window as max_model_len unless the engine
        sets one, the model's vocabulary when it is smaller (:func:`served_vocab`), and
        ``sim_options``. Raises ValueError if the KV cache cannot hold max_model_len, pydantic's
        ValidationError for bad options."""
        profile = get_profile(backend.sim_profile or DEFAULT_PROFILE)
        e = backend.engine
        changes: JSONObject = {
            "block_size": e.block_size,
            "max_num_seqs": e.max_num_seqs,
            "max_model_len": e.max_model_len or (model.context_window if model else None),
            "kv_cache_bytes": e.kv_cache_memory_bytes,
            "gpu_memory_utilization": e.gpu_memory_utilization,
            "max_num_batched_tokens": e.max_num_batched_tokens,
        }
        if e.tensor_parallel_size != 1:
            changes["tensor_parallel_size"] = e.tensor_parallel_size
        profile = profile.with_engine(**{k: v for k, v in changes.items() if v is not None})
        vocab = served_vocab(model)
        if vocab is not None and vocab < profile.model.vocab_size:
            profile = profile.model_copy(
                update={"model": profile.model.model_copy(update={"vocab_size": vocab})}
            )
        return cls(
            profile,
            options=backend.sim_options,
            replica=replica or f"{backend.name}-0",
            backend=backend.name,
            enable_prefix_caching=e.enable_prefix_caching,
            scheduling_policy=e.scheduling_policy,
        )

    # --- EngineBackend protocol -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        opts = self.options
        self._check_alive()
        rid = req.route_key  # one stream per attempt: another attempt may come here too
        if opts.error_rate and self._rng.random() < opts.error_rate:
            raise BackendUnavailable("simulated error", backend=self.backend)
        if rid in self._streams:
            raise InvalidRequest(f"duplicate request id '{rid}'")
        if not req.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        limit = self.engine.max_model_len
        if len(req.prompt_token_ids) >= limit:
            raise ContextLengthExceeded(
                f"prompt of {len(req.prompt_token_ids)} tokens does not fit the {limit}-token context"
            )
        if opts.extra_latency_s and self._rng.random() < opts.extra_latency_fraction:
            self.extra_latency_requests += 1
            try:
                await asyncio.sleep(opts.extra_latency_s / opts.speedup)
            except asyncio.CancelledError:  # e.g. the slow attempt of a hedge race, cancelled
                self.extra_latency_cancelled += 1
                raise
        stream = self._add(req)
        produced = 0
        done = False
        try:
            while True:
                if opts.stall_after_tokens is not None and produced >= opts.stall_after_tokens:
                    self.engine.abort(rid)  # the stalled request stops using the engine
                item = await stream.queue.get()
                if item is _ABORT:
                    done = True
                    self.requests_aborted += 1
                    self._streams.pop(rid, None)  # settled before the last chunk: consumers may stop there
                    yield self._chunk("", [], "abort", stream, produced)
                    return
                if isinstance(item, BaseException):
                    raise item if produced == 0 else StreamInterrupted(str(item), backend=self.backend)
                if opts.stall_after_tokens is not None and produced >= opts.stall_after_tokens:
                    continue  # silent
                ev: TokenEvent = item
                produced += 1
                if ev.finish_reason is not None:
                    done = True
                    self.requests_finished += 1
                    self._streams.pop(rid, None)
                yield self._chunk(fake_word(ev.token_id), [ev.token_id], ev.finish_reason, stream, produced)
                if done:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not done:
                self.engine.abort(rid)
                self.requests_aborted += 1

    @property
    def vocab_size(self) -> int:
        return self.engine.profile.model.vocab_size

    @property
    def kv_block_size(self) -> int | None:
        return self.engine.block_size

    async def after_warmup(self) -> None:
        """A warm-up (on only where the config asks: the model has no cold state) leaves no counts;
        its blocks stay in the simulated cache, whose LRU evicts them first."""
        self.requests_started = self.requests_finished = self.requests_aborted = 0

    async def abort(self, request_id: str) -> None:
        """End a request's streams (every attempt of it here, or one attempt by its route key)."""
        self._check_alive()
        for key, stream in list(self._streams.items()):
            if key == request_id or key.rpartition("/")[0] == request_id:
                self.engine.abort(key)
                stream.queue.put_nowait(_ABORT)

    def stats(self) -> BackendStats:
        self._check_alive()
        e = self.engine
        c = e.counters
        return BackendStats(
            replica=self.replica,
            backend=self.backend,
            kind="sim",
            running=e.num_running,
            waiting=e.num_waiting,
            kv_usage=e.kv_usage(),
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            requests_started=self.requests_started,
            requests_finished=self.requests_finished,
            requests_aborted=self.requests_aborted,
            simulated=True,
            healthy=True,
            extra={
                "profile": e.profile.name,
                "block_size": e.block_size,
                "num_kv_blocks": e.kv.pool.num_blocks,
                "preemptions": c.preemptions,
                "preempted_queries": c.preempted_queries,
                "preempted_hits": c.preempted_hits,
                "evictions": e.kv.pool.evictions,
                "steps": c.steps,
                "virtual_time": e.now,
                "extra_latency_requests": self.extra_latency_requests,
                "extra_latency_cancelled": self.extra_latency_cancelled,
            },
        )

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No stream open and no driver task alive."""
        return not self._streams and self._driver is None

    def shutdown(self) -> None:
        """Abort every open stream (each ends with finish_reason "abort") and stop the driver."""
        for rid, stream in self._streams.items():
            self.engine.abort(rid)
            stream.queue.put_nowait(_ABORT)
        if self._driver is not None:
            self._driver.cancel()

    async def close(self) -> None:
        """``shutdown``, then wait for the driver to end."""
        driver = self._driver
        self.shutdown()
        if driver is not None:
            await asyncio.gather(driver, return_exceptions=True)

    # --- internals ------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.options.dead:
            raise BackendUnavailable("simulated dead replica", backend=self.backend)

    def _vnow(self) -> float:
        loop_now = asyncio.get_running_loop().time()
        if self._anchor is None:
            self._anchor = (loop_now, self.engine.now)
        r0, v0 = self._anchor
        return v0 + (loop_now - r0) * self.options.speedup

    def _add(self, req: GenerateRequest) -> _Stream:
        s = req.sampling
        seed = zlib.crc32(req.request_id.encode()) if s.seed is None else s.seed
        stop_after = None
        if self.options.eos_probability and not s.ignore_eos:
            p = self.options.eos_probability
            stop_after = eos_after(seed, len(req.prompt_token_ids), s.max_tokens, p)
        sim_req = self.engine.add_request(
            req.route_key,
            req.prompt_token_ids,
            s.max_tokens,
            arrival_time=self._vnow(),
            stop_after=stop_after,
            seed=seed,
            priority=req.engine_priority,
            extra_keys=salt_keys(req.cache_salt),  # the tenant's cache group (cluster.engine.kv)
        )
        stream = _Stream(sim_req)
        self._streams[req.route_key] = stream
        self.requests_started += 1
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name=f"sim-{self.replica}")
        return stream

    def _chunk(self, text: str, ids: list[int], reason: str | None, stream: _Stream, produced: int) -> Chunk:
        usage = None
        if reason is not None:
            cached = max(stream.req.num_cached_tokens, 0)
            usage = Usage(
                prompt_tokens=stream.req.prompt_len, completion_tokens=produced, cached_tokens=cached
            )
        return Chunk(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            usage=usage,
            replica=self.replica,
            backend=self.backend,
        )

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        speedup = self.options.speedup
        try:
            while self.engine.has_work() or self.engine.next_arrival() is not None:
                result = self.engine.step(self._vnow())
                if result is None:
                    break
                assert self._anchor is not None
                r0, v0 = self._anchor
                await asyncio.sleep(max(0.0, r0 + (result.end - v0) / speedup - loop.time()))
                for ev in result.outputs:
                    stream = self._streams.get(ev.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(ev)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the model must not leave streams hanging
            err = BackendUnavailable(f"simulated engine failed: {exc!r}", backend=self.backend)
            for stream in self._streams.values():
                stream.queue.put_nowait(err)
        finally:
            self._driver = None
