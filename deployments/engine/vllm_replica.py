"""A vLLM v1 engine (``AsyncLLM``) behind the backend interface: token ids in, typed chunks out.

One engine per replica, prefix caching on, vLLM's priority scheduling policy by default: each
request carries its surface's priority and the gateway's cache rank
(``GenerateRequest.engine_priority``), so a Tab request waiting in the engine goes before waiting
Agent work, Agent work is preempted first under KV pressure, and within a surface a request whose
context this engine has cached goes before one whose context it has not.
Cancelling the consumer aborts the engine request (closing vLLM's generator aborts it; we also
call ``abort`` explicitly so the engine frees the request's KV blocks at once). ``stats()`` reads a
snapshot that a custom stat logger keeps from vLLM's own scheduler stats, so it costs nothing and
never awaits the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.config import BackendConfig, ModelConfig
from cluster.engine.kv_events import KVEventLog
from cluster.policy.cpu_class import CpuClassPolicy
from cluster.tokens import resolve_model_path
from cluster.wire import logprobs
from cluster.wire.errors import ENGINE_DEAD_CODE, BackendUnavailable, InvalidRequest, StreamInterrupted
from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest, Usage
from deployments.cpu_sched import CoreClassReport, EngineCoreClass
from deployments.engine.amx import request_amx

if TYPE_CHECKING:  # vLLM's imports are not followed (pyproject's mypy overrides): these are names
    from vllm.config import VllmConfig
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    from deployments.engine.vllm_kv_events import VLLMEventSubscriber

log = logging.getLogger(__name__)


@dataclass
class _EngineCounters:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0


def _stat_logger_factory(counters: _EngineCounters) -> type[StatLoggerBase]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM's types are skipped: Any
        """Keeps the latest scheduler stats and running prefix-cache totals (vLLM's units: tokens)."""

        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self.counters = counters

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            *args: object,
            **kwargs: object,
        ) -> None:
            if scheduler_stats is None:
                return
            c = self.counters
            c.running = scheduler_stats.num_running_reqs
            c.waiting = scheduler_stats.num_waiting_reqs
            c.kv_usage = scheduler_stats.kv_cache_usage
            pcs = scheduler_stats.prefix_cache_stats
            if pcs is not None:
                c.prefix_queries += pcs.queries
                c.prefix_hits += pcs.hits

        def log_engine_initialized(self) -> None:
            pass

    return SnapshotLogger


def engine_kwargs(backend: BackendConfig, model: ModelConfig) -> dict[str, object]:
    e = backend.engine
    kw: dict[str, object] = {  # vLLM's AsyncEngineArgs, by keyword
        "model": resolve_model_path(model.path or model.name),
        "served_model_name": model.name,
        "enable_prefix_caching": e.enable_prefix_caching,
        "enforce_eager": e.enforce_eager,
        "tensor_parallel_size": e.tensor_parallel_size,
        "max_model_len": e.max_model_len or model.context_window,
        "disable_log_stats": False,
        "scheduling_policy": e.scheduling_policy,
    }
    optional = {
        "block_size": e.block_size,
        "max_num_seqs": e.max_num_seqs,
        "kv_cache_memory_bytes": e.kv_cache_memory_bytes,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "max_num_batched_tokens": e.max_num_batched_tokens,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    kw.update(e.extra)
    return kw


class VLLMBackend:
    """Implements :class:`cluster.wire.backend.EngineBackend` over an in-process vLLM ``AsyncLLM``."""

    def __init__(self, backend: BackendConfig, model: ModelConfig, replica: str) -> None:
        for k, v in backend.env.items():
            os.environ.setdefault(k, v)
        if backend.engine.cpu_nice:  # before the engine starts: its threads inherit the niceness
            os.nice(backend.engine.cpu_nice)
        # Before the engine's first attention step, which dies with SIGILL on AMX hosts otherwise.
        self.amx = request_amx(log)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.backend = backend.name
        self.replica = replica
        # vLLM reads a request's priority only under its priority policy; under fcfs it stays 0.
        self._priorities = backend.engine.scheduling_policy == "priority"
        self._counters = _EngineCounters()
        self._started = self._finished = self._aborted = 0
        # The last aborted requests and how far they got: operators and tests see the abort land.
        self._recent_aborts: deque[tuple[str, int]] = deque(maxlen=64)
        kw = engine_kwargs(backend, model)
        self.kv_events: KVEventLog | None = None
        self._kv_sub: VLLMEventSubscriber | None = None
        # KV events mean something only with the prefix cache on; an explicit extra wins.
        if (
            backend.affinity.kv_events
            and backend.engine.enable_prefix_caching
            and "kv_events_config" not in kw
        ):
            import asyncio

            from deployments.engine.vllm_kv_events import VLLMEventSubscriber, kv_events_config

            self.kv_events = KVEventLog()
            self._kv_sub = VLLMEventSubscriber(self.kv_events, asyncio.get_running_loop())
            kw["kv_events_config"] = kv_events_config(self._kv_sub.port)
        args = AsyncEngineArgs(**kw)
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._counters)])
        self._num_blocks = _num_blocks(self.engine)
        self.cpu_class: EngineCoreClass | None = None
        if backend.engine.cpu_sched != "normal":  # the engine core's class from the traffic
            self.cpu_class = EngineCoreClass(CpuClassPolicy(backend.engine.cpu_sched))

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        from vllm.inputs import TokensPrompt

        params = _sampling_params(req)
        k = req.sampling.logprobs
        self._started += 1
        if self.cpu_class is not None:
            self.cpu_class.note_request(time.monotonic(), req.priority)
        engine_id = f"{req.request_id}-{req.attempt}"  # a hedge or retry may reach this replica too
        completion_tokens = 0
        cached = 0
        finished = False
        try:
            prompt = TokensPrompt(prompt_token_ids=req.prompt_token_ids)
            if req.cache_salt:  # the tenant's cache group: its prefix cache finds no other group's
                prompt["cache_salt"] = req.cache_salt
            stream = self.engine.generate(
                prompt,
                params,
                request_id=engine_id,
                priority=req.engine_priority if self._priorities else 0,
            )
            async for out in stream:
                if out.num_cached_tokens is not None:
                    cached = out.num_cached_tokens
                # n > 1: each output is one choice's delta (vLLM's child requests), indexed
                chunks = [self._chunk(o, k, req.sampling.n, out.finished) for o in out.outputs]
                if out.prompt_logprobs and chunks:  # the first output's (asked for; later ones: [])
                    chunks[0].prompt_logprobs = logprobs.prompt_shape(out.prompt_logprobs)
                completion_tokens += sum(len(c.token_ids) for c in chunks)
                if out.finished:
                    finished = True
                    chunks = chunks or [Chunk(replica=self.replica, backend=self.backend)]
                    chunks[-1].usage = Usage(len(req.prompt_token_ids), completion_tokens, cached)
                for chunk in chunks:
                    yield chunk
        except Exception as exc:
            if completion_tokens:
                raise StreamInterrupted(f"vLLM replica {self.replica} failed mid-stream: {exc}") from exc
            if _client_error(exc):  # e.g. a schema xgrammar cannot compile: the client's, never retried
                raise InvalidRequest(f"vLLM refused the request: {exc}") from exc
            dead = ENGINE_DEAD_CODE if self.engine.errored else None  # the gateway picks another
            raise BackendUnavailable(
                f"vLLM replica {self.replica} failed: {exc}", backend=self.backend, code=dead
            ) from exc
        finally:
            if finished:
                self._finished += 1
            else:
                # Cancelled or failed: make sure the engine stops generating and frees the blocks.
                self._aborted += 1
                self._recent_aborts.append((req.request_id, completion_tokens))
                await self.abort(engine_id)

    def _chunk(self, o: CompletionOutput, k: int | None, n: int, finished: bool) -> Chunk:
        """One output of vLLM's as a chunk: with ``n`` > 1 its choice's index and its own finish."""
        chunk = Chunk(text=o.text, token_ids=list(o.token_ids), replica=self.replica, backend=self.backend)
        if k is not None and o.logprobs:
            chunk.logprobs = logprobs.from_engine(o.token_ids, o.logprobs, k, o.text)
        if n > 1:
            chunk.index, chunk.finish_reason = o.index, o.finish_reason
        elif finished:
            chunk.finish_reason = o.finish_reason or "stop"
        return chunk

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vllm_config.model_config.get_vocab_size())

    @property
    def kv_block_size(self) -> int | None:
        return None  # the gateway hashes with the config's block size (or 16): vLLM's runs with that

    async def after_warmup(self) -> None:
        """The warm-up's prompts leave no cache (KV events: all blocks cleared) and no counts."""
        if not await self.engine.reset_prefix_cache():
            log.warning("replica %s: the prefix cache kept the warm-up's blocks", self.replica)
        c = self._counters
        c.prefix_queries = c.prefix_hits = 0
        self._started = self._finished = self._aborted = 0
        self._recent_aborts.clear()

    async def abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # the engine may already have dropped it
            log.debug("abort of %s failed", request_id, exc_info=True)

    def stats(self) -> BackendStats:
        c = self._counters
        return BackendStats(
            replica=self.replica,
            backend=self.backend,
            kind="vllm",
            running=c.running,
            waiting=c.waiting,
            kv_usage=c.kv_usage,
            prefix_cache_queries=c.prefix_queries,
            prefix_cache_hits=c.prefix_hits,
            requests_started=self._started,
            requests_finished=self._finished,
            requests_aborted=self._aborted,
            # A dead EngineCore (its process crashed) leaves AsyncLLM answering every request with
            # EngineDeadError: the replica reports itself unhealthy, Serve's health check fails and
            # Serve replaces it, and the gateways stop choosing it at once.
            healthy=not self.engine.errored,
            extra={
                "unfinished": self.engine.get_num_unfinished_requests(),
                "num_kv_blocks": self._num_blocks,
                "recent_aborts": list(self._recent_aborts),
                # the engine cores' scheduling class (engine.cpu_sched), kept current here too
                "engine_cpu_class": self._cpu_class_report(),
                "amx": self.amx.status,  # deployments/engine/amx.py: the tile state asked before the engine
                "ts": time.time(),
            },
        )

    def _cpu_class_report(self) -> CoreClassReport | None:
        if self.cpu_class is None:
            return None
        self.cpu_class.apply(time.monotonic())  # a hold that ran out ends within a stats period
        return self.cpu_class.report()

    def shutdown(self) -> None:
        if self._kv_sub is not None:
            self._kv_sub.stop()
        self.engine.shutdown()


def _sampling_params(req: GenerateRequest) -> SamplingParams:
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    s = req.sampling
    # response_format or a forced tool call: vLLM's structured decoding holds every token to the schema.
    so = StructuredOutputsParams(**s.structured) if s.structured else None
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        # a tool plan's own stop strings (one call only: stop at its end) join the client's
        stop=[*s.stop, *(req.tool_parse or {}).get("stop", ())] or None,
        seed=s.seed,
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        structured_outputs=so,
        logprobs=s.logprobs,
        n=s.n,
        prompt_logprobs=s.prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
    )


def _client_error(exc: BaseException) -> bool:
    """vLLM's own request errors (VLLMClientError: validation, an unsupported or broken grammar),
    or a ValueError its input checks raise before the first token."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # an older vLLM
        return isinstance(exc, ValueError)
    return isinstance(exc, VLLMClientError | ValueError)


def _num_blocks(engine: AsyncLLM) -> int:
    """The engine's KV cache in blocks (0 if this vLLM does not say)."""
    try:
        return int(engine.vllm_config.cache_config.num_gpu_blocks or 0)
    except (AttributeError, TypeError, ValueError):
        return 0
