"""The simulated engine: a vLLM-v1-like scheduler over a paged, prefix-cached KV cache, with step
times from a profile (:mod:`cluster.engine.profiles`). Plain synchronous Python on a virtual clock.

The model
---------
* **Requests** arrive with prompt token ids, ``max_tokens`` and a ``priority``. They wait until the
  scheduler admits them, in vLLM's order (``scheduling_policy``, :mod:`cluster.engine.request_queue`):
  arrival order (``fcfs``), or lowest priority number first, then arrival (``priority``). Then
  they run until they have produced their output; each output token is a deterministic fake id,
  so a sequence's blocks hash the same way every time it is recomputed.
* **A step** is one forward pass of the batch. Its token budget is ``max_num_batched_tokens``,
  spent Sarathi-style: first one token for every decoding sequence, then the remaining prompt
  chunks of running sequences, then new (waiting) sequences, each prompt cut to what is left of
  the budget (chunked prefill), at most ``max_num_seqs`` running. A new sequence first looks up its
  cached prefix (:mod:`cluster.engine.kv`) and only computes the rest.
* **Step time** comes from the profile's step-time model (roofline on GPUs: max(compute, weights +
  KV read) + fixed overhead; fitted-linear for the CPU tiny model). Everything a step produces
  happens at its end: the sequences that finished their prompt or decoded get one new token then.
  The first step after the engine ran dry pays the profile's *idle wake* (``EngineSpec.idle_wake``:
  vLLM-CPU's threads sleep after a few ms idle; 0 on the GPU profiles).
* **KV exhaustion** never crashes: a running sequence that needs a block it cannot get preempts
  another (possibly itself): under ``fcfs`` the newest running sequence not yet scheduled in this
  step; under ``priority`` the running sequence with the highest priority number, latest arrival
  first, even one already scheduled in this step (its tokens go back to the budget), as vLLM v1
  does. As in vLLM, a waiting request never preempts: when ``max_num_seqs`` are running, a
  waiting Tab request takes the next free seat ahead of every waiting Agent request. Preemption is
  vLLM v1's recompute style: its blocks are freed (full ones stay in the prefix cache), it goes
  back to the queue (``fcfs``: its front; ``priority``: by its key) and later recomputes prompt +
  output so far, usually hitting its own blocks. No new sequence is admitted in a step that
  preempted; a new sequence that does not fit waits.
* **Prefix-cache counters** follow vLLM: on admission ``prefix_cache_queries += num_tokens`` and
  ``prefix_cache_hits += cached tokens`` (a multiple of the block size, at most num_tokens - 1).
  Re-admissions of preempted sequences count apart (``preempted_queries``/``preempted_hits``), as
  vLLM does, so that victims re-hitting their own blocks do not inflate the hit rate. Unlike vLLM,
  a sequence that waits for memory is counted once, when admitted, not at every retry.

Two clocks: :meth:`EngineModel.run_until` / :meth:`EngineModel.run` drive the virtual clock as a
discrete-event simulation (arrivals, then back-to-back steps while there is work); the real-time
driver (:mod:`cluster.engine.sim_backend`) calls :meth:`EngineModel.step` with its own ``now`` and sleeps
each step's duration.

Not modelled: speculative decoding, pipeline parallelism, async scheduling overlap, sampling
cost differences, stop strings, CPU offload, the host↔GPU transfers of a real engine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from cluster.engine.kv import BlockHash, ExtraKeys, KVCacheManager, hash_request_tokens
from cluster.engine.kv_events import KVCacheEvent
from cluster.engine.profiles import BatchShape, Profile, StepTimeModel
from cluster.engine.request_queue import SchedulingPolicy, WaitQueue

_MASK64 = (1 << 64) - 1


def fake_token_id(seed: int, index: int, vocab_size: int) -> int:
    """A deterministic pseudo-random output token (splitmix64 of seed and position)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % vocab_size


def prefix_digest(token_ids: list[int], value: int = 0) -> int:
    """A running CRC-32 of a token sequence: ``prefix_digest(a + b) == prefix_digest(b,
    prefix_digest(a))``, so a continuation whose prompt is the prompt plus the tokens already
    sampled reaches the same digest the uninterrupted sequence had at that point."""
    return zlib.crc32(array("I", token_ids).tobytes(), value)


def next_digest(value: int, token_id: int) -> int:
    return zlib.crc32(token_id.to_bytes(4, sys.byteorder), value)


def seeded_token_id(seed: int, digest: int, position: int, vocab_size: int) -> int:
    """The sampler: the token at absolute ``position`` is a function of the seed, the sequence
    before it (its digest) and the position alone, so continuing a request elsewhere (prompt +
    tokens emitted, same seed) samples exactly what the uninterrupted run would have."""
    return fake_token_id((seed << 32) ^ digest, position, vocab_size)


class Status(Enum):
    PENDING = "pending"  # arrival time in the future
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One sequence in the engine, and its timeline (virtual seconds)."""

    request_id: str
    token_ids: list[int]  # prompt, then output tokens as they are sampled
    prompt_len: int
    max_tokens: int
    arrival_time: float
    seed: int
    stop_after: int | None = None  # a sampled output length that ends with finish_reason "stop"
    extra_keys: ExtraKeys | None = None
    priority: int = 0  # lower is scheduled first under the priority policy
    digest: int = 0  # prefix_digest of token_ids: the sampler's view of the sequence so far
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix hit at first admission (vLLM's num_cached_tokens)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "length", "stop" or "abort"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_decoding(self) -> bool:
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(slots=True)
class TokenEvent:
    """A token produced at the end of a step; ``finish_reason`` set on a sequence's last one."""

    request_id: str
    token_id: int
    finish_reason: str | None = None


@dataclass(slots=True)
class StepResult:
    start: float
    end: float
    batch: BatchShape
    outputs: list[TokenEvent]
    preempted: list[str]
    num_running: int
    num_waiting: int

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class EngineCounters:
    prefix_cache_queries: int = 0  # tokens looked up by first admissions (vLLM's units)
    prefix_cache_hits: int = 0  # of which found cached
    preempted_queries: int = 0  # the same for re-admissions after preemption (not exported by vLLM)
    preempted_hits: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0  # tokens computed as prompt (or recompute) chunks
    generated_tokens: int = 0
    busy_time: float = 0.0  # virtual seconds spent in steps


class EngineModel:
    """A simulated vLLM replica. Synchronous; time only moves through ``step``/``run_until``."""

    def __init__(
        self,
        profile: Profile,
        *,
        enable_prefix_caching: bool = True,
        keep_finished: bool = True,
        start_time: float = 0.0,
        step_time_model: StepTimeModel | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
        on_kv_events: Callable[[list[KVCacheEvent], float], None] | None = None,
    ) -> None:
        """``on_kv_events(events, end)``: called at the end of each step that stored or evicted
        cached blocks, with vLLM's events for it (:mod:`cluster.engine.kv_events`); None: no events."""
        e = profile.engine
        self.profile = profile
        self.block_size = e.block_size
        self.max_num_seqs = e.max_num_seqs
        self.max_num_batched_tokens = e.max_num_batched_tokens
        self.max_model_len = profile.max_model_len()
        self.vocab_size = profile.model.vocab_size
        self.step_time_model = step_time_model or profile.step_time_model()
        num_blocks = profile.num_kv_blocks()
        if math.ceil(self.max_model_len / self.block_size) > num_blocks:
            raise ValueError(
                f"profile '{profile.name}': max_model_len {self.max_model_len} needs more KV blocks than the "
                f"cache has ({num_blocks} * {self.block_size} tokens); lower max_model_len"
            )
        self.kv = KVCacheManager(
            num_blocks, self.block_size, enable_prefix_caching, events_enabled=on_kv_events is not None
        )
        self._on_kv_events = on_kv_events
        self.now = start_time
        self._drained_at: float | None = start_time  # end of the last step that left nothing to do
        self.counters = EngineCounters()
        self.keep_finished = keep_finished
        self.requests: dict[str, SimRequest] = {}  # unfinished (and finished, if keep_finished)
        self.scheduling_policy = scheduling_policy
        self.waiting: WaitQueue[SimRequest] = WaitQueue(scheduling_policy)
        self.running: list[SimRequest] = []
        self._pending: list[tuple[float, int, SimRequest]] = []  # heap of future arrivals
        self._arrivals = itertools.count()

    # --- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        arrival_time: float | None = None,
        stop_after: int | None = None,
        extra_keys: ExtraKeys | None = None,
        seed: int | None = None,
        priority: int = 0,
    ) -> SimRequest:
        """Queue a request; it joins the waiting queue at ``arrival_time`` (default: now)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id '{request_id}'")
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room in {self.max_model_len}"
            )
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        arrival = self.now if arrival_time is None else arrival_time
        req = SimRequest(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            prompt_len=len(prompt_token_ids),
            max_tokens=max_tokens,
            arrival_time=arrival,
            seed=zlib.crc32(request_id.encode()) if seed is None else seed,
            stop_after=stop_after,
            extra_keys=extra_keys,
            priority=priority,
            digest=prefix_digest(prompt_token_ids),
        )
        hash_request_tokens(req.token_ids, self.block_size, extra_keys, req.block_hashes)
        self.requests[request_id] = req
        self.counters.requests_added += 1
        if arrival > self.now:
            req.status = Status.PENDING
            heapq.heappush(self._pending, (arrival, next(self._arrivals), req))
        else:
            self.waiting.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self._pending = [p for p in self._pending if p[2] is not req]
            heapq.heapify(self._pending)
        self._finish(req, "abort", self.now)
        self.counters.requests_aborted += 1
        return True

    # --- state ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.kv.pool.usage()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_arrival(self) -> float | None:
        return self._pending[0][0] if self._pending else None

    # --- clocks ---------------------------------------------------------------------------
    def run_until(self, t: float) -> int:
        """Advance the virtual clock to ``t``: arrivals, then steps back to back while there is work.
        A step that starts before ``t`` completes (``now`` may end a little past ``t``). Returns the
        number of steps run."""
        steps = 0
        while True:
            self._admit_arrivals()
            if self.has_work():
                if self.now >= t or self.step() is None:
                    break
                steps += 1
                continue
            nxt = self.next_arrival()
            if nxt is not None and nxt <= t:
                self.now = max(self.now, nxt)
                continue
            if math.isfinite(t):
                self.now = max(self.now, t)
            return steps
        return steps

    def run(self) -> int:
        """Run until every request added so far has finished."""
        return self.run_until(math.inf)

    def step(self, now: float | None = None) -> StepResult | None:
        """Run one step starting at ``max(now, self.now)``; None when nothing could be scheduled."""
        if now is not None and now > self.now:
            self.now = now
        self._admit_arrivals()
        scheduled, preempted = self._schedule()
        if not scheduled and preempted:  # everyone was preempted: memory is free again, admit anew
            scheduled, more = self._schedule()
            preempted += more
        if not scheduled:
            return None
        batch = _batch_shape(scheduled)
        start = self.now
        # vLLM's engine core blocks on its input queue when it has nothing to do; its threads sleep.
        wake = 0.0 if self._drained_at is None else self.profile.engine.idle_wake(start - self._drained_at)
        end = start + self.step_time_model.step_time(batch) + wake
        outputs = self._apply(scheduled, end)
        self.now = end
        ran_dry = not self.running and not self.waiting and not (self._pending and self._pending[0][0] <= end)
        self._drained_at = end if ran_dry else None
        c = self.counters
        c.steps += 1
        c.busy_time += end - start
        c.prefill_tokens += int(batch.prefill_tokens)  # whole here (fractional only in the planner)
        c.generated_tokens += len(outputs)
        if self._on_kv_events is not None:
            events = self.kv.take_events()
            if events:
                self._on_kv_events(events, end)
        return StepResult(start, end, batch, outputs, preempted, len(self.running), len(self.waiting))

    # --- internals ------------------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        while self._pending and self._pending[0][0] <= self.now:
            _, _, req = heapq.heappop(self._pending)
            req.status = Status.WAITING
            self.waiting.add(req)

    def _schedule(self) -> tuple[dict[SimRequest, int], list[str]]:
        budget = self.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted: list[str] = []
        decodes = [r for r in self.running if r.is_decoding]
        prefills = [r for r in self.running if not r.is_decoding]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                victim = self._victim(scheduled)
                budget += scheduled.pop(victim, 0)  # priority: a victim scheduled earlier gives back
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
                continue
            break  # as vLLM: once a running sequence cannot be scheduled, the step is full
        if preempted:
            return scheduled, preempted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits = self.kv.computed_blocks(req.block_hashes, req.num_tokens)
            num_hit = len(hits) * self.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req.request_id, num_hit + n, hits):
                break  # no memory: wait for running sequences to finish
            self.waiting.pop()
            self._count_lookup(req, num_hit)
            req.status = Status.RUNNING
            req.num_computed_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.now
            self.running.append(req)
            scheduled[req] = n
            budget -= n
        return scheduled, preempted

    def _victim(self, scheduled: dict[SimRequest, int]) -> SimRequest:
        """Whom to preempt for memory: vLLM v1's choice under each policy."""
        if self.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return next(r for r in reversed(self.running) if r not in scheduled)

    def _count_lookup(self, req: SimRequest, num_hit: int) -> None:
        c = self.counters
        if req.num_preemptions:
            c.preempted_queries += req.num_tokens
            c.preempted_hits += num_hit
        else:
            c.prefix_cache_queries += req.num_tokens
            c.prefix_cache_hits += num_hit
            req.num_cached_tokens = num_hit

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.prepend(req)

    def _apply(self, scheduled: dict[SimRequest, int], end: float) -> list[TokenEvent]:
        """Effects of a step, at its end: computed tokens cached, new tokens sampled, finishes."""
        outputs: list[TokenEvent] = []
        for req, n in scheduled.items():
            req.num_computed_tokens += n
            self.kv.cache_request(req)  # its full, computed blocks (and their events)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk: no token yet
            token = seeded_token_id(req.seed, req.digest, req.num_tokens, self.vocab_size)
            req.digest = next_digest(req.digest, token)
            req.token_ids.append(token)
            hash_request_tokens(req.token_ids, self.block_size, req.extra_keys, req.block_hashes)
            req.token_times.append(end)
            if req.first_token_time is None:
                req.first_token_time = end
            reason = self._finish_reason(req)
            outputs.append(TokenEvent(req.request_id, token, reason))
            if reason is not None:
                self._finish(req, reason, end)
                self.counters.requests_finished += 1
        if any(r.status is Status.FINISHED for r in scheduled):
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return outputs

    def _finish_reason(self, req: SimRequest) -> str | None:
        n = req.num_output_tokens
        if req.stop_after is not None and n >= req.stop_after:
            return "stop"
        if n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: SimRequest, reason: str, when: float) -> None:
        self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = when
        if not self.keep_finished:
            del self.requests[req.request_id]


def _batch_shape(scheduled: dict[SimRequest, int]) -> BatchShape:
    prefill = decode = kv_read = pairs = 0
    for req, n in scheduled.items():
        past = req.num_computed_tokens  # before this step
        if req.is_decoding:
            decode += 1
        else:
            prefill += n
        kv_read += past + n
        pairs += n * past + n * (n + 1) // 2
    return BatchShape(prefill_tokens=prefill, decode_tokens=decode, kv_read_tokens=kv_read, attn_pairs=pairs)
