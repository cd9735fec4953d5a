"""SimBackend in real time: streaming, usage and stats, cancellation, abort, fault knobs, config."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from cluster.config import BackendConfig, EngineArgs, ModelConfig
from cluster.engine.profiles import FittedCoefficients, Profile
from cluster.engine.sim_backend import SimBackend, SimOptions, fake_word
from cluster.wire.backend import EngineBackend
from cluster.wire.errors import BackendUnavailable, ContextLengthExceeded, InvalidRequest
from cluster.wire.protocol import Chunk, GenerateRequest, Sampling, Usage
from tests.unit.engine_profiles import linear_profile

PREFILL = 0.1e-3
DECODE_BASE = 1e-3
PER_SEQ = 0.2e-3
OVERHEAD = 0.5e-3


def profile() -> Profile:
    fitted = FittedCoefficients(
        prefill_s_per_token=PREFILL, decode_base_s=DECODE_BASE, decode_s_per_seq=PER_SEQ
    )
    return linear_profile(fitted, OVERHEAD, max_model_len=128)


def make(**options: object) -> SimBackend:
    return SimBackend(profile(), options=dict(options), replica="r0", backend="simb")


def greq(rid: str, prompt: list[int], max_tokens: int = 5, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="tiny",
        kind="completion",
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def collect(b: SimBackend, req: GenerateRequest) -> list[Chunk]:
    return [c async for c in b.generate(req)]


async def settled(b: SimBackend) -> bool:
    """True once no stream is open and the driver task has ended (nothing leaked)."""
    for _ in range(200):
        if b.idle:
            return True
        await asyncio.sleep(0.005)
    return False


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


async def test_streams_one_chunk_per_token_with_usage_on_the_last() -> None:
    b = make()
    assert isinstance(b, EngineBackend)
    chunks = await collect(b, greq("a", toks(0, 8), 5))
    assert len(chunks) == 5
    for c in chunks:
        assert len(c.token_ids) == 1 and c.text == fake_word(c.token_ids[0])
        assert c.replica == "r0" and c.backend == "simb"
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    assert [c.usage for c in chunks[:-1]] == [None] * 4
    assert chunks[-1].usage == Usage(prompt_tokens=8, completion_tokens=5, cached_tokens=0)
    s = b.stats()
    assert (s.kind, s.simulated, s.healthy, s.replica, s.backend) == ("sim", True, True, "r0", "simb")
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)
    assert (s.requests_started, s.requests_finished, s.requests_aborted) == (1, 1, 0)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (8, 0)
    assert await settled(b)


async def test_a_repeated_prompt_reports_cached_tokens() -> None:
    b = make()
    await collect(b, greq("a", toks(0, 13), 2))
    chunks = await collect(b, greq("b", toks(0, 13), 2))
    assert chunks[-1].usage == Usage(prompt_tokens=13, completion_tokens=2, cached_tokens=12)
    s = b.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (26, 12)
    assert await settled(b)


async def test_concurrent_streams_share_steps_and_stats_show_them_running() -> None:
    b = make()
    tasks = [asyncio.create_task(collect(b, greq(f"r{i}", toks(100 * i, 8), 30))) for i in range(4)]
    await asyncio.sleep(0.01)
    mid = b.stats()
    assert mid.running == 4 and mid.kv_usage > 0
    results = await asyncio.gather(*tasks)
    assert [len(r) for r in results] == [30] * 4
    assert b.engine.counters.steps < 4 * 30  # batched
    assert await settled(b)


async def test_timing_follows_the_model_scaled_by_speedup() -> None:
    virtual = (OVERHEAD + 8 * PREFILL) + 39 * (OVERHEAD + DECODE_BASE + PER_SEQ)
    b = make()
    t0 = time.perf_counter()
    await collect(b, greq("a", toks(0, 8), 40))
    assert time.perf_counter() - t0 >= 0.95 * virtual
    fast = make(speedup=50)
    t0 = time.perf_counter()
    await collect(fast, greq("a", toks(0, 8), 40))
    assert time.perf_counter() - t0 < virtual
    assert await settled(b) and await settled(fast)


async def test_cancelling_the_consumer_aborts_and_frees_blocks() -> None:
    b = make()
    got: list[Chunk] = []

    async def consume() -> None:
        async for c in b.generate(greq("long", toks(0, 8), 100)):
            got.append(c)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.001)
    assert b.stats().kv_usage > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = b.stats()
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)
    assert (s.requests_started, s.requests_finished, s.requests_aborted) == (1, 0, 1)
    assert b.engine.counters.requests_aborted == 1
    assert await settled(b)


async def test_closing_the_iterator_aborts() -> None:
    b = make()
    gen = b.generate(greq("a", toks(0, 8), 100))
    await anext(gen)
    await gen.aclose()  # type: ignore[attr-defined]
    s = b.stats()
    assert (s.running, s.kv_usage, s.requests_aborted) == (0, 0.0, 1)
    assert await settled(b)


async def test_abort_ends_the_stream_with_finish_reason_abort() -> None:
    b = make()
    gen = b.generate(greq("a", toks(0, 8), 100))
    first = await anext(gen)
    assert first.finish_reason is None
    await b.abort("a")
    assert b.stats().kv_usage == 0.0
    rest = [c async for c in gen]
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 1
    assert b.stats().requests_aborted == 1
    await b.abort("unknown")  # harmless
    assert await settled(b)


async def test_request_errors() -> None:
    b = make()
    with pytest.raises(ContextLengthExceeded):
        await collect(b, greq("big", toks(0, 128), 1))
    with pytest.raises(InvalidRequest):
        await collect(b, greq("empty", [], 1))
    gen = b.generate(greq("dup", toks(0, 4), 50))
    await anext(gen)
    with pytest.raises(InvalidRequest, match="duplicate"):
        await collect(b, greq("dup", toks(0, 4), 1))
    await gen.aclose()  # type: ignore[attr-defined]
    assert b.stats().requests_started == 1
    assert await settled(b)


async def test_close_ends_open_streams() -> None:
    b = make()
    gen = b.generate(greq("a", toks(0, 8), 1000))
    await anext(gen)
    await b.close()
    rest = [c async for c in gen]
    assert rest[-1].finish_reason == "abort"
    s = b.stats()
    assert (s.running, s.kv_usage, s.requests_aborted) == (0, 0.0, 1)
    assert await settled(b)


# --- fault knobs ------------------------------------------------------------------------------


async def test_dead_replica_raises_on_every_call() -> None:
    b = make(dead=True)
    with pytest.raises(BackendUnavailable) as info:
        await collect(b, greq("a", toks(0, 4)))
    assert info.value.backend == "simb"
    with pytest.raises(BackendUnavailable):
        b.stats()
    with pytest.raises(BackendUnavailable):
        await b.abort("a")
    assert b.requests_started == 0 and await settled(b)


async def test_error_rate_fails_before_the_first_token() -> None:
    always = make(error_rate=1.0)
    with pytest.raises(BackendUnavailable):
        await collect(always, greq("a", toks(0, 4)))
    assert always.stats().requests_started == 0
    half = make(error_rate=0.5, seed=1)
    failures = 0
    for i in range(20):
        try:
            await collect(half, greq(f"r{i}", toks(0, 4), 1))
        except BackendUnavailable:
            failures += 1
    assert 0 < failures < 20
    assert half.stats().requests_finished == 20 - failures
    assert await settled(half)


async def test_extra_latency_delays_the_first_token_of_a_fraction() -> None:
    async def ttft(b: SimBackend, rid: str) -> float:
        t0 = time.perf_counter()
        gen = b.generate(greq(rid, toks(0, 4), 1))
        await anext(gen)
        elapsed = time.perf_counter() - t0
        await gen.aclose()  # type: ignore[attr-defined]
        return elapsed

    slow = make(extra_latency_s=0.15, extra_latency_fraction=1.0)
    assert await ttft(slow, "a") >= 0.15
    never = make(extra_latency_s=0.15, extra_latency_fraction=0.0)
    assert await ttft(never, "a") < 0.15
    scaled = make(extra_latency_s=0.15, extra_latency_fraction=1.0, speedup=10)
    assert await ttft(scaled, "a") < 0.15
    assert await settled(slow) and await settled(never) and await settled(scaled)


def test_replicas_of_one_backend_draw_their_faults_independently() -> None:
    """Same seed, same sequence on one replica; another replica draws its own (one shared sequence
    made a hedge of a slow call slow too)."""

    def draws(replica: str) -> list[float]:
        b = SimBackend(profile(), options={"seed": 7}, replica=replica, backend="simb")
        return [b._rng.random() for _ in range(8)]

    assert draws("r0") == draws("r0")
    assert draws("r0") != draws("r1")


async def test_a_request_cancelled_while_delayed_is_counted() -> None:
    """The slow attempt of a hedge race is cancelled during its delay, before the engine ever saw
    it: counted there, since no other counter holds it."""
    b = make(extra_latency_s=5.0, extra_latency_fraction=1.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(b.generate(greq("a", toks(0, 4), 1))), 0.05)
    s = b.stats()
    assert (s.extra["extra_latency_requests"], s.extra["extra_latency_cancelled"]) == (1, 1)
    assert (s.requests_started, s.requests_finished, s.requests_aborted) == (0, 0, 0)
    assert await settled(b)


@pytest.mark.parametrize("after", [0, 2])
async def test_stall_after_tokens_goes_silent_until_cancelled(after: int) -> None:
    b = make(stall_after_tokens=after)
    gen = b.generate(greq("a", toks(0, 8), 50))
    got = [await anext(gen) for _ in range(after)]
    assert len(got) == after
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(gen), 0.1)  # cancels the stalled stream
    s = b.stats()
    assert (s.running, s.kv_usage, s.requests_finished, s.requests_aborted) == (0, 0.0, 0, 1)
    assert await settled(b)


async def test_abort_reaches_a_stalled_stream() -> None:
    b = make(stall_after_tokens=1)
    gen = b.generate(greq("a", toks(0, 8), 50))
    await anext(gen)
    nxt = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0.02)
    assert not nxt.done()
    await b.abort("a")
    last = await nxt
    assert last.finish_reason == "abort"
    assert await settled(b)


async def test_eos_probability_samples_shorter_outputs_unless_ignore_eos() -> None:
    b = make(eos_probability=0.3, seed=5)
    reasons = []
    for i in range(10):
        chunks = await collect(b, greq(f"r{i}", toks(0, 4), 20))
        last = chunks[-1]
        assert last.usage is not None and last.usage.completion_tokens == len(chunks)
        reasons.append((last.finish_reason, len(chunks)))
    assert any(r == "stop" and n < 20 for r, n in reasons)
    assert all(n == 20 for r, n in reasons if r == "length")
    chunks = await collect(b, greq("x", toks(0, 4), 20, ignore_eos=True))
    assert len(chunks) == 20 and chunks[-1].finish_reason == "length"
    assert await settled(b)


# --- config -----------------------------------------------------------------------------------


def test_from_config_lays_engine_args_and_options_over_the_profile() -> None:
    cfg = BackendConfig(
        name="sim-a",
        kind="sim",
        model="tiny",
        sim_profile="cpu-tiny",
        engine=EngineArgs(
            block_size=32,
            max_num_seqs=8,
            kv_cache_memory_bytes=4 * 2**20,
            enable_prefix_caching=False,
            max_num_batched_tokens=512,
            scheduling_policy="priority",
        ),
        sim_options={"speedup": 5, "seed": 3, "error_rate": 0.1},
    )
    model = ModelConfig(name="tiny", tokenizer="@tiny", context_window=1024)
    b = SimBackend.from_config(cfg, model)
    e = b.engine
    assert (e.block_size, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len) == (32, 8, 512, 1024)
    assert e.scheduling_policy == "priority"
    assert e.kv.pool.num_blocks == 4 * 2**20 // (512 * 32)
    assert not e.kv.enable_caching
    assert b.options == SimOptions(speedup=5, seed=3, error_rate=0.1)
    assert (b.replica, b.backend) == ("sim-a-0", "sim-a")
    assert SimBackend.from_config(cfg, model, "x").replica == "x"  # as deployments/ calls it

    default = SimBackend.from_config(BackendConfig(name="d", kind="sim", model="tiny"))
    assert default.engine.profile.name == "cpu-tiny" and default.options == SimOptions()


def test_sim_options_are_validated() -> None:
    with pytest.raises(ValidationError, match="sped"):
        SimOptions.model_validate({"sped": 2})
    with pytest.raises(ValidationError):
        SimOptions(error_rate=1.5)
    with pytest.raises(ValidationError):
        SimBackend.from_config(BackendConfig(name="d", kind="sim", model="m", sim_options={"speedup": 0}))
    for name, f in SimOptions.model_fields.items():
        assert f.description, name


def test_fake_words_are_distinct_per_token() -> None:
    words = [fake_word(i) for i in range(2048)]
    assert len(set(words)) == 2048 and all(w.startswith(" ") for w in words)


async def test_the_engine_queues_by_the_requests_engine_priority() -> None:
    """The surface's priority and the gateway's cache rank reach the simulated engine's queue key."""
    b = make()
    req = greq("ranked", toks(0, 8), 40)
    req.priority, req.cache_rank = 2, 1
    gen = b.generate(req)
    await anext(gen)  # running: the engine still holds it
    assert b.engine.requests[req.route_key].priority == req.engine_priority == 5
    assert len([c async for c in gen]) == 39
    assert await settled(b)


def test_a_sim_serving_a_model_draws_its_token_ids_below_that_models_vocabulary(tmp_path) -> None:
    """The rehearsal's sim (an 8B profile, vocab 128,256) served the tiny model (vocab 2,048): a
    stream migrated from it to vLLM fed vLLM ids past its vocabulary, and every such continuation
    failed. The served model's vocabulary now bounds the fake ids; a bigger one changes nothing."""
    cfg = BackendConfig(name="s", kind="sim", model="tiny-llama", sim_profile="llama-3.1-8b-h100")
    tiny = ModelConfig(name="tiny-llama", tokenizer="@tiny", path="@tiny", context_window=2048)
    assert SimBackend.from_config(cfg, tiny).vocab_size == 2048
    (tmp_path / "config.json").write_text('{"vocab_size": 32000}')
    folder = ModelConfig(name="m", tokenizer="@tiny", path=str(tmp_path), context_window=2048)
    assert SimBackend.from_config(cfg, folder).vocab_size == 32000
    (tmp_path / "config.json").write_text('{"vocab_size": 200000}')
    assert SimBackend.from_config(cfg, folder).vocab_size == 128_256
    no_weights = ModelConfig(name="m", tokenizer="@tiny", context_window=2048)
    assert SimBackend.from_config(cfg, no_weights).vocab_size == 128_256
