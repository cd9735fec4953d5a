"""The vLLM-CPU affinity benchmark's pure parts: the unlimited-KV bound, counter parsing and
deltas, the settle rule, the rounds' summary, the scenario config."""

from __future__ import annotations

import pytest

from loadtest.benchmarks import bench_affinity_vllm as b
from loadtest.common.ray_llm_peer import _REPLICA, _SERIES


def test_unlimited_kv_counts_whole_blocks_seen_before() -> None:
    a = list(range(100))  # 3 full blocks of 32 and a tail
    again = [*range(96), 7, 7, 7, 7, 7]  # the same 3 blocks, another tail
    other = [1000 + i for i in range(64)]
    # first: nothing seen; second: 3 blocks (96 tokens); third: nothing
    assert b.unlimited_kv_hit_rate([a, again, other], 32) == round(96 / (100 + 101 + 64), 4)
    # a prompt's last token is never a hit: 64 tokens repeated hit one block, not two
    assert b.unlimited_kv_hit_rate([other, other], 32) == round(32 / 128, 4)
    assert b.unlimited_kv_hit_rate([], 32) == 0.0


def test_vllm_metrics_are_summed_per_server() -> None:
    text = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1200.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 640.0\n'
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
    )
    found = b._METRIC.findall(text)
    assert found == [("queries", "1200.0"), ("hits", "640.0")]


def test_ray_metrics_are_read_per_replica() -> None:
    text = (
        'ray_vllm_prefix_cache_queries_total{ReplicaId="a1",model_name="tiny-llama"} 500.0\n'
        'ray_vllm_prefix_cache_hits_total{ReplicaId="a1",model_name="tiny-llama"} 200.0\n'
        'ray_vllm_prefix_cache_queries_total{ReplicaId="b2",model_name="tiny-llama"} 300.0\n'
    )
    series = _SERIES.findall(text)
    assert [(k, _REPLICA.search(labels).group(1), v) for k, labels, v in series] == [  # type: ignore[union-attr]
        ("queries", "a1", "500.0"),
        ("hits", "a1", "200.0"),
        ("queries", "b2", "300.0"),
    ]


def test_delta_is_per_replica_and_a_new_replica_starts_at_zero() -> None:
    d = b._delta({"r1": (100, 10)}, {"r1": (300, 110), "r2": (50, 0)})
    assert d == {
        "hit_rate": round(100 / 250, 4),
        "queries": 250,
        "hits": 100,
        "queries_per_replica": [200, 50],
    }
    assert b._delta({}, {})["hit_rate"] is None


def test_settled_waits_for_every_prompt_token_sent() -> None:
    reads = iter([{"r": (10, 0)}, {"r": (10, 0)}, {"r": (40, 5)}, {"r": (40, 5)}])
    # Two equal reads of 10 are not enough when 40 tokens were sent: it reads on until they count.
    assert b.settled(lambda: next(reads), at_least=40, timeout_s=10) == {"r": (40, 5)}


def test_rounds_are_kept_and_averaged_and_a_failed_one_counted() -> None:
    r1 = {"hit_rate": 0.5, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "ttft_p99_ms": 30.0}
    r2 = {"hit_rate": 0.7, "ttft_p50_ms": 30.0, "ttft_p90_ms": 40.0, "ttft_p99_ms": 50.0}
    out = b._combined([r1, {"failed": "boom"}, r2])
    assert (out["rounds"], out["failed_rounds"], out["runs"][1]) == (3, 1, {"failed": "boom"})
    assert (out["hit_rate"], out["ttft_p50_ms"], out["ttft_p90_ms"], out["ttft_p99_ms"]) == (
        0.6,
        20.0,
        30.0,
        40.0,
    )
    assert b._combined([{"failed": "x"}])["hit_rate"] is None


def test_goals_compare_ours_with_vllm_router() -> None:
    pol = {
        "ours": {"hit_rate": 0.6, "ttft_p90_ms": 100.0},
        "vllm_router_cache_aware": {"hit_rate": 0.4, "ttft_p90_ms": 150.0},
    }
    assert b.goals(pol) == {"hit_rate_minus_vllm_router": 0.2, "ttft_p90_vllm_router_over_ours": 1.5}
    assert b.goals({"ours": pol["ours"]}) == {}


@pytest.mark.parametrize("rank", [True, False])
def test_the_scenario_config_cuts_the_kv_cache_and_sets_the_rank(rank: bool) -> None:
    cfg = b.config(8192, cache_priority=rank)
    backend = next(x for x in cfg.backends if x.kind == "vllm")
    assert backend.engine.kv_cache_memory_bytes == 8192 * 512  # the tiny model: 512 bytes a token
    assert backend.affinity.cache_priority is rank and backend.replicas == 2


def test_unknown_scenarios_and_policies_are_refused() -> None:
    with pytest.raises(SystemExit):
        b.parse_args(["--scenario", "nope"])
    with pytest.raises(SystemExit):
        b.parse_args(["--policies", "ours,bogus"])
    args = b.parse_args(["--policies", "ours,ray_prefix", "--repeat", "2"])
    assert args.policy_list == ["ours", "ray_prefix"] and args.repeat == 2
