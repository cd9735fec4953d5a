"""Runs an engine replica's warm-up (:mod:`cluster.engine.warmup`) through its own backend, before
the replica serves: each prompt's time to its first token and in all, logged once and kept for
the replica's stats, so a slow start says where its time went."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from cluster.engine.kv_events import KVEventLog
from cluster.engine.warmup import WarmupPlan, WarmupPrompt
from cluster.wire.backend import EngineBackend
from cluster.wire.protocol import GenerateRequest, Sampling

log = logging.getLogger("ray.serve")


class WarmableBackend(EngineBackend, Protocol):
    """An engine backend that can be warmed up: its vocabulary, and what it resets afterwards
    (the warm-up's requests leave no counts and, where the engine can drop it, no cache)."""

    @property
    def vocab_size(self) -> int: ...

    async def after_warmup(self) -> None: ...

    @property
    def kv_block_size(self) -> int | None:
        """The engine's own KV block size where the replica's config leaves it open (None: the
        engine does not say; the router's default applies)."""

    @property
    def kv_events(self) -> KVEventLog | None:
        """The engine's KV events for the gateways (None: this engine does not publish them)."""

    def shutdown(self) -> None:
        """Stop the engine: every open stream ends (the replica is draining)."""


@dataclass
class WarmupReport:
    """What the warm-up took: in all, and per prompt (label → [first token, whole] in ms)."""

    total_ms: float = 0.0
    prompts: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f} ms" for k, v in self.prompts.items())
        return f"{self.total_ms:.0f} ms ({parts})" + (f"; failed: {self.error}" if self.error else "")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


async def _one(
    backend: EngineBackend, model: str, p: WarmupPrompt, first: asyncio.Event | None = None
) -> list[float]:
    """Runs one warm-up prompt to its end; returns [first token ms, whole ms]."""
    req = GenerateRequest(
        request_id=f"warmup-{p.label}",
        model=model,
        kind="completion",
        prompt_token_ids=p.prompt_token_ids,
        sampling=Sampling(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True),
        surface="warmup",
    )
    t0 = time.perf_counter()
    ttft = None
    async for _ in backend.generate(req):
        if ttft is None:
            ttft = time.perf_counter() - t0
            if first is not None:
                first.set()
    end = time.perf_counter() - t0
    return [1000 * (ttft if ttft is not None else end), 1000 * end]


async def run_warmup(backend: WarmableBackend, model: str, plan: WarmupPlan, name: str) -> WarmupReport:
    """The plan's prompts in order, then its mixed step (the prefill sent once the decode has its
    first token, so that they share engine steps). A failure is reported, not raised: a replica
    whose engine cannot run these will fail its first requests and its health check the same way."""
    report = WarmupReport()
    t0 = time.perf_counter()
    try:
        for p in plan.prompts:
            report.prompts[p.label] = await _one(backend, model, p)
        if plan.mixed is not None:
            decode, prefill = plan.mixed
            started = asyncio.Event()
            running = asyncio.ensure_future(_one(backend, model, decode, started))
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait({running, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()  # the decode failed before its first token: `await running` raises
            report.prompts[prefill.label] = await _one(backend, model, prefill)
            report.prompts[decode.label] = await running
        await backend.after_warmup()
    except Exception as exc:  # reported in the log and the stats
        report.error = f"{type(exc).__name__}: {exc}"
    report.total_ms = 1000 * (time.perf_counter() - t0)
    level = logging.WARNING if report.error else logging.INFO
    log.log(level, "engine replica %s warmed up in %s", name, report.summary())
    return report
