"""The shared-pool overload benchmark's pure parts: the two variants' configs and a phase's keys."""

from __future__ import annotations

from loadtest.benchmarks.bench_overload_shared import phase_report, variant_config
from loadtest.common.sim_live import Result


def test_variants_differ_only_in_engine_priority_the_guard_and_prefill_avoidance() -> None:
    on, off = variant_config("on"), variant_config("off")
    assert [b.name for b in on.backends] == [b.name for b in off.backends] == ["sim-shared"]
    assert on.backends[0].engine.scheduling_policy == "priority" and on.policies.slo_guard.enabled
    assert off.backends[0].engine.scheduling_policy == "fcfs" and not off.policies.slo_guard.enabled
    assert on.backends[0].engine.max_num_batched_tokens == off.backends[0].engine.max_num_batched_tokens
    assert on.surface("tab").avoid_prefill_tokens == 512 and off.surface("tab").avoid_prefill_tokens is None
    assert on.surface("agent").avoid_prefill_tokens is None
    same = [s.model_copy(update={"avoid_prefill_tokens": None}) for s in on.surfaces]
    assert same == off.surfaces and on.routes == off.routes


def _r(i: int, surface: str, status: int, ttft: float | None, latency: float, tokens: int) -> Result:
    return Result(i, f"s{i}", surface, status=status, ttft_s=ttft, latency_s=latency, output_tokens=tokens)


def test_phase_report_keys() -> None:
    cfg = variant_config("on")
    results = [
        _r(0, "tab", 200, 0.05, 0.1, 16),
        _r(1, "agent", 200, 1.0, 2.0, 64),  # within Agent's 3 s objective: goodput
        _r(2, "agent", 200, 4.0, 5.0, 64),  # late: not goodput
        _r(3, "agent", 429, None, 0.002, 0),
    ]
    counters = {"admitted": 0, "completed": 0, "errored": 0, "cancelled": 0, "in_flight": 0, "waiting": 0}
    after = {**counters, "admitted": 3, "completed": 3, "balanced": True}
    rep = phase_report(results, cfg, 10.0, ({**counters, "balanced": True}, after))
    assert rep["surfaces"]["agent"]["goodput_tok_s"] == 6.4
    assert rep["surfaces"]["tab"]["ttft_p99_wall_ms"] == 50.0
    assert rep["reject_p99_ms"] == 2.0 and rep["hung"] == 0
    assert rep["checks"] == {
        "admitted_equals_ended": True,
        "nothing_in_flight_or_waiting_after": True,
        "counters_balanced": True,
    }


def test_vllm_variants_are_the_local_cluster_with_the_feature_toggled() -> None:
    on, off = variant_config("on", "vllm"), variant_config("off", "vllm")
    assert [b.kind for b in on.backends] == [b.kind for b in off.backends] == ["vllm"]
    assert on.backends[0].engine.scheduling_policy == "priority" and on.policies.slo_guard.enabled
    assert off.backends[0].engine.scheduling_policy == "fcfs" and not off.policies.slo_guard.enabled
    assert on.server.gateway_replicas == off.server.gateway_replicas == 1
    assert on.surface("tab").avoid_prefill_tokens == 512  # configs/local.yaml's
    same = [s.model_copy(update={"avoid_prefill_tokens": None}) for s in on.surfaces]
    assert on.name != off.name and same == off.surfaces


def test_vllm_shapes_fit_the_tiny_models_context() -> None:
    """Agent's longest prompt plus its output stays inside the tiny model's 2,048 tokens, and
    Tab's prompts are short: the shapes of the issue's trial."""
    from cluster.tokens import load
    from loadtest.benchmarks.bench_overload import workloads
    from loadtest.benchmarks.bench_overload_shared import VLLM_SHAPES

    cfg = variant_config("on", "vllm")
    window = cfg.models[0].context_window
    tok = load(cfg.models[0].tokenizer)
    specs = workloads({"tab": 4.0, "agent": 6.0}, 30.0, 3, shapes=VLLM_SHAPES)
    longest = {
        s: max(tok.count_chat(x.messages) + x.max_tokens for x in specs if x.surface == s)
        for s in ("tab", "agent")
    }
    assert (
        longest["agent"] <= window
        and min(tok.count_chat(x.messages) for x in specs if x.surface == "agent") >= 900
    )
    assert longest["tab"] <= 600


async def test_the_floor_probe_times_each_answer_beside_the_work_and_stops_with_it() -> None:
    """``with_floor_probe``: GETs beside the work in the same loop, a 200's time recorded, anything
    else not; the work's own result comes back and no probe outlives it."""
    import asyncio

    from aiohttp import web

    from loadtest.benchmarks.bench_overload_shared import with_floor_probe

    hits = {"ok": 0, "bad": 0}

    async def ok(_: web.Request) -> web.Response:
        hits["ok"] += 1
        return web.Response(text="ok")

    async def bad(_: web.Request) -> web.Response:
        hits["bad"] += 1
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/floor/ping", ok)
    app.router.add_get("/down", bad)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        times: list[float] = []
        got = await with_floor_probe(asyncio.sleep(0.3, result="done"), base + "/floor/ping", times, 0.02)
        assert got == "done"
        assert len(times) == hits["ok"] >= 5 and all(0 < t < 1 for t in times)
        after = hits["ok"]
        await asyncio.sleep(0.1)
        assert hits["ok"] == after  # stopped with the work
        refused: list[float] = []
        await with_floor_probe(asyncio.sleep(0.1), base + "/down", refused, 0.02)
        assert hits["bad"] >= 2 and refused == []
    finally:
        await runner.cleanup()
