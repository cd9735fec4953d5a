"""An engine replica's warm-up: the plan (pure) and its runner over a backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cluster.engine.warmup import WarmupConfig, plan, prompt_lengths, token_ids
from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest
from deployments.engine.engine_warmup import run_warmup


def test_prompt_lengths_climb_to_the_top_on_a_log_scale() -> None:
    assert prompt_lengths(2040, 4) == [32, 128, 511, 2040]
    assert prompt_lengths(131_064, 7)[0] == 32 and prompt_lengths(131_064, 7)[-1] == 131_064
    assert prompt_lengths(20, 4) == [20]  # a window below the first step: one prompt
    assert prompt_lengths(4096, 1) == [4096]


def test_the_plan_reaches_the_window_and_mixes_a_prefill_with_a_decode() -> None:
    p = plan(WarmupConfig(), window=2048, vocab_size=2048)
    lengths = [len(x.prompt_token_ids) for x in p.prompts]
    assert lengths[-1] == 2048 - 8 and len(lengths) == 4
    assert p.mixed is not None
    decode, prefill = p.mixed
    assert decode.max_tokens > prefill.max_tokens and len(prefill.prompt_token_ids) == 512
    every = [*p.prompts, decode, prefill]
    assert len({x.prompt_token_ids[0] for x in every}) == len(every)  # no shared prefix: full prefills
    assert all(5 <= t < 2048 for x in every for t in x.prompt_token_ids)
    capped = plan(WarmupConfig(max_prompt_tokens=300, steps=2, mixed_step=False), 2048, 2048)
    assert [len(x.prompt_token_ids) for x in capped.prompts] == [32, 300] and capped.mixed is None


def test_token_ids_stay_inside_a_small_vocabulary() -> None:
    assert all(5 <= t < 7 for t in token_ids(100, 3, 7))


class _Engine:
    """A backend whose streams yield ``tokens`` chunks with a pause: enough to see the order."""

    def __init__(self, fail: str | None = None) -> None:
        self.seen: list[tuple[str, int]] = []
        self.running: set[str] = set()
        self.overlap: list[str] = []
        self.reset = 0
        self.fail = fail

    @property
    def vocab_size(self) -> int:
        return 2048

    async def after_warmup(self) -> None:
        self.reset += 1

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        self.seen.append((req.request_id, len(req.prompt_token_ids)))
        if self.fail and self.fail in req.request_id:
            raise RuntimeError("engine died")
        if self.running:
            self.overlap.append(req.request_id)
        self.running.add(req.request_id)
        try:
            for i in range(req.sampling.max_tokens):
                await asyncio.sleep(0.001)
                yield Chunk(text="x", token_ids=[7], finish_reason="length" if i else None)
        finally:
            self.running.discard(req.request_id)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> BackendStats:
        return BackendStats(replica="r", backend="b", kind="vllm")


def test_the_runner_runs_the_prompts_in_order_then_the_mixed_step_and_resets() -> None:
    engine = _Engine()
    p = plan(WarmupConfig(), window=2048, vocab_size=2048)
    report = asyncio.run(run_warmup(engine, "m", p, "b/r"))
    assert report.error is None and engine.reset == 1
    assert [n for _, n in engine.seen] == [32, 128, 511, 2040, 16, 512]
    assert engine.overlap == ["warmup-mixed-prefill-512"]  # sent while the decode ran
    assert set(report.prompts) == {x.label for x in [*p.prompts, *(p.mixed or ())]}
    assert all(first <= whole for first, whole in report.prompts.values()) and report.total_ms > 0


@pytest.mark.parametrize("dies", ["prefill-128", "mixed-decode"])
def test_a_failing_engine_is_reported_not_raised_and_never_hangs(dies: str) -> None:
    engine = _Engine(fail=dies)
    p = plan(WarmupConfig(), window=2048, vocab_size=2048)
    report = asyncio.run(asyncio.wait_for(run_warmup(engine, "m", p, "b/r"), timeout=10))
    assert report.error == "RuntimeError: engine died" and engine.reset == 0


def test_the_simulated_engine_runs_the_warmup_and_forgets_its_counts() -> None:
    """The sim has no cold state (its warm-up is off unless asked), but when a config asks, it runs
    the same plan through the same interface and keeps no counts of it."""
    from cluster.config import load_config
    from cluster.engine.sim_backend import SimBackend

    cfg = load_config("configs/sim-local.yaml")
    sim = SimBackend.from_config(cfg.backends[0], cfg.models[0], "r1")
    p = plan(WarmupConfig(enabled=True, max_prompt_tokens=1024, steps=2), 8192, sim.vocab_size)

    async def run() -> object:
        try:
            return await asyncio.wait_for(run_warmup(sim, cfg.models[0].name, p, "sim/r1"), timeout=60)
        finally:
            await sim.close()

    report = asyncio.run(run())
    assert report.error is None, report.error
    assert set(report.prompts) == {"prefill-32", "prefill-1024", "mixed-decode", "mixed-prefill-512"}
    stats = sim.stats()
    assert stats.requests_started == stats.requests_finished == 0
