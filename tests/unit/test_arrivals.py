"""Arrival processes and trace replay (loadtest/common/arrivals.py), the per-surface request shapes
built on them (loadtest/common/surfaces.py) and the benchmark runner's pure statistics
(loadtest/common/runner.py)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from loadtest.common import arrivals
from loadtest.common.request_spec import RequestSpec
from loadtest.common.runner import (
    Result,
    goodput,
    histogram_quantiles,
    metrics_delta,
    parse_prometheus,
    quantile,
    server_summary,
    summarize,
)
from loadtest.common.surfaces import SHAPES, Session, parse_mix, schedule


# --- arrival processes ------------------------------------------------------------------------------
def test_poisson_is_seeded_sorted_and_bounded() -> None:
    a = arrivals.poisson(5.0, duration_s=100, seed=3)
    assert a == arrivals.poisson(5.0, duration_s=100, seed=3)
    assert a != arrivals.poisson(5.0, duration_s=100, seed=4)
    assert a == sorted(a) and a[0] > 0 and a[-1] < 100
    assert len(arrivals.poisson(5.0, n=17, seed=3)) == 17
    assert arrivals.poisson(5.0, n=17, seed=3) == a[:17]  # n and duration cut the same sequence


def test_poisson_rate_and_cv() -> None:
    stats = arrivals.gap_stats(arrivals.poisson(10.0, n=20_000, seed=1))
    assert stats["rate"] == pytest.approx(10.0, rel=0.05)
    assert stats["cv"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_keeps_the_rate_and_sets_the_burstiness(cv: float) -> None:
    stats = arrivals.gap_stats(arrivals.gamma_bursty(4.0, cv, n=40_000, seed=2))
    assert stats["rate"] == pytest.approx(4.0, rel=0.08)
    assert stats["cv"] == pytest.approx(cv, rel=0.1)


def test_bursty_arrivals_clump() -> None:
    """Same mean rate, more one-second windows that are empty or crowded than Poisson."""

    def extremes(times: list[float]) -> int:
        counts = [0] * int(times[-1] + 1)
        for t in times:
            counts[int(t)] += 1
        return sum(c == 0 or c >= 10 for c in counts)

    p = arrivals.poisson(4.0, n=20_000, seed=5)
    g = arrivals.gamma_bursty(4.0, 3.0, n=20_000, seed=5)
    assert extremes(g) > 3 * extremes(p)


def test_uniform_and_dispatch() -> None:
    assert arrivals.uniform(4.0, duration_s=1.01) == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert arrivals.arrivals("gamma", 2.0, n=5, cv=2.0, seed=9) == arrivals.gamma_bursty(
        2.0, 2.0, n=5, seed=9
    )
    assert arrivals.arrivals("poisson", 2.0, n=5, seed=9) == arrivals.poisson(2.0, n=5, seed=9)
    with pytest.raises(ValueError, match="unknown arrival process"):
        arrivals.arrivals("weibull", 1.0, n=1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: arrivals.poisson(0, n=1),
        lambda: arrivals.gamma_bursty(1, 0, n=1),
        lambda: arrivals.poisson(1),
        lambda: arrivals.poisson(1, duration_s=-1),
    ],
)
def test_bad_arguments_raise(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_a_shared_generator_continues_its_stream() -> None:
    rng = random.Random(0)
    first = arrivals.poisson(1.0, n=3, seed=rng)
    second = arrivals.poisson(1.0, n=3, seed=rng)
    assert first != second


# --- traces -----------------------------------------------------------------------------------------
def test_trace_round_trip_sorted_and_scaled(tmp_path) -> None:
    path = tmp_path / "sub" / "trace.jsonl"
    recs = [{"t": 2.0, "surface": "tab", "x": [1, 2]}, {"t": 0.5, "surface": "chat"}]
    assert arrivals.write_trace(path, recs) == 2
    assert [r["t"] for r in arrivals.read_trace(path)] == [0.5, 2.0]
    assert arrivals.read_trace(path)[1] == {"t": 2.0, "surface": "tab", "x": [1, 2]}
    assert [r["t"] for r in arrivals.read_trace(path, time_scale=0.5)] == [0.25, 1.0]
    assert len(arrivals.read_trace(path, limit=1)) == 1
    text = path.read_text()
    arrivals.write_trace(path, list(reversed(recs)))
    assert path.read_text() == text  # byte-identical whatever the input order


def test_trace_skips_comments_and_names_bad_lines(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('# a comment\n\n{"t": 1}\n{"surface": "tab"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:4: every record needs a number 't'"):
        arrivals.read_trace(path)
    path.write_text('{"t": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r":2: not JSON"):
        arrivals.read_trace(path)


def test_a_schedule_survives_the_trace(tmp_path) -> None:
    specs = schedule(arrivals.poisson(3.0, n=40, seed=1), parse_mix("mixed"), seed=1, context_window=4096)
    path = tmp_path / "s.jsonl"
    arrivals.write_trace(path, [s.to_record() for s in specs])
    back = [RequestSpec.from_record(r) for r in arrivals.read_trace(path)]
    assert back == specs


# --- surfaces ---------------------------------------------------------------------------------------
def test_schedule_is_deterministic_and_follows_the_mix() -> None:
    times = arrivals.poisson(5.0, n=2000, seed=2)
    a = schedule(times, parse_mix("tab=6,chat=3,agent=1"), seed=7, context_window=8192)
    assert [s.to_record() for s in a] == [
        s.to_record() for s in schedule(times, parse_mix("tab=6,chat=3,agent=1"), seed=7, context_window=8192)
    ]
    share = {n: sum(s.surface == n for s in a) / len(a) for n in ("tab", "chat", "agent")}
    assert share["tab"] == pytest.approx(0.6, abs=0.05)
    assert share["agent"] == pytest.approx(0.1, abs=0.03)
    assert all(s.arrival_s == t for s, t in zip(a, times, strict=True))


def test_surface_shapes() -> None:
    specs = schedule(arrivals.poisson(5.0, n=3000, seed=3), parse_mix("mixed"), seed=3, context_window=8192)
    tab = [s for s in specs if s.surface == "tab"]
    agent = [s for s in specs if s.surface == "agent"]
    assert all(s.kind == "completion" and s.path == "/v1/completions" for s in tab)
    assert all(s.kind == "chat" and s.messages for s in agent)
    assert 0.25 < sum(s.cancel_after_s is not None for s in tab) / len(tab) < 0.45
    assert max(s.max_tokens for s in tab) <= SHAPES["tab"].output_tokens[1]
    assert min(s.prompt_tokens_est for s in agent) > 10 * max(s.max_tokens for s in tab)
    # Agent sessions share one repository context and grow turn by turn.
    systems = {s.messages[0]["content"] for s in agent}
    assert len(systems) == 1
    by_session: dict[str, list[RequestSpec]] = {}
    for s in agent:
        by_session.setdefault(s.session_id, []).append(s)
    grown = [v for v in by_session.values() if len(v) > 1]
    assert grown
    for turns in grown:
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert all(a.prompt_tokens_est < b.prompt_tokens_est for a, b in itertools_pairs(turns))
        assert turns[1].messages[: len(turns[0].messages)] == turns[0].messages  # a prefix: cache hits


def itertools_pairs(xs: list[RequestSpec]) -> list[tuple[RequestSpec, RequestSpec]]:
    return list(itertools.pairwise(xs))


def test_tab_prefix_grows_as_the_user_types() -> None:
    sess = Session(SHAPES["tab"], "tab-x", random.Random(1), context_window=2048)
    a, b = sess.next(), sess.next()
    assert a is not None and b is not None and a.prompt and b.prompt
    assert b.prompt.startswith(a.prompt) and len(b.prompt) > len(a.prompt)
    assert a.headers() == {"x-surface": "tab", "x-session-id": "tab-x"}
    body = a.body("m")
    assert body["prompt"] == a.prompt and body["stream"] and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("scale", [1.0, 0.2])
def test_requests_fit_the_context_window(scale: float) -> None:
    times = arrivals.poisson(5.0, n=1500, seed=4)
    specs = schedule(times, parse_mix("agent"), seed=4, context_window=2048, scale=scale)
    assert len(specs) > 0.9 * len(times)
    assert all(s.prompt_tokens_est + s.max_tokens <= 0.9 * 2048 for s in specs)
    assert max(s.turn for s in specs) >= 1  # still multi-turn


def test_closed_loop_session_uses_the_real_reply() -> None:
    sess = Session(SHAPES["chat"], "c", random.Random(0), context_window=8192)
    sess.turns_left = 3
    first = sess.next()
    sess.observe("the real answer")
    second = sess.next()
    assert first is not None and second is not None
    assert second.messages[len(first.messages)] == {"role": "assistant", "content": "the real answer"}


def test_parse_mix() -> None:
    assert parse_mix("tab") == {"tab": 1.0}
    assert sum(parse_mix("mixed").values()) == pytest.approx(1.0)
    assert parse_mix("tab=1,chat=3") == {"tab": 0.25, "chat": 0.75}
    with pytest.raises(ValueError, match="unknown surface"):
        parse_mix("tab=1,voice=2")


def test_request_record_validation() -> None:
    with pytest.raises(ValueError, match="needs 'messages'"):
        RequestSpec.from_record(
            {"surface": "chat", "kind": "chat", "session_id": "s", "turn": 0, "max_tokens": 1}
        )


# --- runner statistics ------------------------------------------------------------------------------
def _res(surface: str, ttft: float | None, status: str = "ok", e2e: float = 1.0, tokens: int = 10) -> Result:
    return Result(surface, "s", 0, 0.0, status=status, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)


def test_quantile() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([5.0], 0.99) == 5.0
    assert math.isnan(quantile([], 0.5))


def test_goodput_ignores_cancels_nobody_waited_for() -> None:
    rs = [
        _res("tab", 0.05),  # good
        _res("tab", 0.2),  # late
        _res("tab", None, status="error"),  # failed
        _res("tab", None, status="cancelled", e2e=0.03),  # gone before the 100 ms objective: not judged
        _res("tab", None, status="cancelled", e2e=0.3),  # waited past it with no token: a miss
        _res("tab", 0.08, status="cancelled", e2e=0.2),  # token in time, then cancelled: good
    ]
    g = goodput(rs, 100.0, wall_s=2.0)
    assert (g["good"], g["judged"]) == (2, 5)
    assert g["goodput"] == 0.4


def test_summarize_by_surface() -> None:
    rs = [_res("tab", 0.05), _res("chat", 0.5), _res("chat", 2.0), _res("chat", None, status="error")]
    rs[-1].error = "http_429:rate_limit_exceeded"
    s = summarize(rs, 10.0, {"tab": 100.0, "chat": 1000.0})
    assert s["overall"]["requests"] == 4 and s["overall"]["errors"] == 1
    assert s["surfaces"]["chat"]["errors_by_type"] == {"http_429:rate_limit_exceeded": 1}
    assert s["surfaces"]["chat"]["goodput"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["overall"]["goodput"] == 0.5
    assert s["surfaces"]["tab"]["ttft_ms"]["p50"] == 50.0


PROM = """# HELP ray_llmc_ttft_seconds x
ray_llmc_ttft_seconds_bucket{Component="core_worker",WorkerId="a",surface="tab",le="0.01"} 1.0
ray_llmc_ttft_seconds_bucket{Component="core_worker",WorkerId="a",surface="tab",le="0.1"} 3.0
ray_llmc_ttft_seconds_bucket{Component="core_worker",WorkerId="a",surface="tab",le="+Inf"} 4.0
ray_llmc_ttft_seconds_count{WorkerId="a",surface="tab"} 4.0
ray_llmc_tokens_total{WorkerId="a",kind="prompt",surface="tab",backend="b"} 100.0
ray_llmc_tokens_total{WorkerId="b",kind="prompt",surface="tab",backend="b"} 50.0
ray_llmc_prefix_cache_hits_total{backend="b",replica="r1"} 30.0
ray_llmc_prefix_cache_queries_total{backend="b",replica="r1"} 100.0
ray_serve_other 7
"""


def test_prometheus_parse_delta_and_quantiles() -> None:
    after = parse_prometheus(PROM)
    assert (
        after[("ray_llmc_tokens_total", (("backend", "b"), ("kind", "prompt"), ("surface", "tab")))] == 150.0
    )
    assert not any(name.startswith("ray_serve") for name, _ in after)
    before = parse_prometheus(PROM.replace("} 3.0", "} 1.0").replace("} 4.0", "} 1.0"))
    d = metrics_delta(before, after)
    q = histogram_quantiles(d, "ray_llmc_ttft_seconds", "surface")
    # Over the run: 0 in the first bucket, 2 in (10, 100] ms, 1 above: p50 inside the second bucket.
    assert q["tab"]["count"] == 3.0
    assert 10.0 < q["tab"]["p50"] < 100.0
    assert q["tab"]["p99"] == 100.0  # the +Inf bucket reports its lower edge
    server = server_summary(
        parse_prometheus(PROM.replace("} 30.0", "} 10.0").replace("} 100.0", "} 50.0")), after
    )
    assert server["prefix_cache_hit_rate"] == pytest.approx(20 / 50)
    assert server_summary({}, {}) == {"available": False}


def test_trace_records_are_json_plain() -> None:
    spec = schedule([0.1], {"chat": 1.0}, seed=0)[0]
    assert json.loads(json.dumps(spec.to_record()))["surface"] == "chat"


# --- bench CLI plumbing (no cluster) ----------------------------------------------------------------
def test_variants_overrides_and_report(tmp_path) -> None:
    import argparse

    from loadtest.benchmarks.cli_bench import (
        Variant,
        add_bench_parser,
        coerce_spec,
        load_variants,
        markdown,
        set_path,
    )

    raw = {"backends": [{"routing": "cache_aware"}], "server": {}}
    set_path(raw, "backends.0.routing", "round_robin")
    set_path(raw, "server.port", 9)
    assert raw == {"backends": [{"routing": "round_robin"}], "server": {"port": 9}}

    vfile = tmp_path / "v.yaml"
    vfile.write_text(
        "variants:\n  - {name: rr, config: configs/sim-local.yaml, set: {backends.0.routing: round_robin}}\n"
    )
    ap = argparse.ArgumentParser()
    add_bench_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", "--variant", "a=configs/sim-local.yaml", "--variants", str(vfile)])
    vs = load_variants(args)
    assert [v.name for v in vs] == ["a", "rr"]
    assert vs[1].load().backends[0].routing == "round_robin"
    assert Variant("x", "configs/sim-local.yaml").load().backends[0].routing == "cache_aware"

    # A spec of the other workload module's shape (arrival_s, tuple of messages, surface None).
    theirs = {"arrival_s": 1.5, "session_id": "g0-s1", "messages": ({"role": "user", "content": "hi"},)}
    spec, timed = coerce_spec({**theirs, "max_tokens": 8, "group": "g0", "turn": 0, "surface": None})
    assert timed and spec.arrival_s == 1.5 and spec.kind == "chat" and spec.surface == "chat"
    assert spec.messages == [{"role": "user", "content": "hi"}]

    rs = [_res("tab", 0.05), _res("chat", 0.5)]
    summary = summarize(rs, 2.0, {"tab": 100.0, "chat": 1000.0})
    report = {
        "meta": {"workload": "mixed", "created": "now", "arrival": "poisson", "rate": 1.0, "duration_s": 2.0}
        | {"seed": 0, "scale": 1.0, "machine": "test"},
        "variants": [
            {
                "name": n,
                "summary": summary,
                "server": {"available": False},
                "schedule_sha": "ab",
                "startup_s": 1.0,
            }
            for n in ("a", "b")
        ],
    }
    report["variants"].append({"name": "c", "config": "x.yaml", "error": "RuntimeError('no Ray')"})
    md = markdown(report)
    assert "**c failed**" in md
    assert "| | a | b |" in md and "## tab" in md and "| TTFT p50 ms | 275 | 275 |" in md
