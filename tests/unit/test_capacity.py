"""The capacity planner: hand-computed KV, TPM/RPM, cost and binding cases; the demand file's
errors name the field (also through the CLI, exit code 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import main as cli_main
from cluster.config import ClusterConfig, parse_config
from cluster.engine.profiles import GiB, get_profile
from cluster.planner.capacity import plan
from cluster.planner.demand import Demand, DemandError, TokenDist, parse_demand
from cluster.planner.replica_model import ReplicaModel, Workload, backend_profile

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
H100_KV_TOKENS = int(80e9 * 0.9 - 8_030_261_248 * 2 - 2 * GiB) // (128 * 1024 * 16) * 16


def config(**engine: Any) -> ClusterConfig:
    """gpu.yaml in small: Llama-3.1-8B on vLLM H100 replicas, two providers, a long-context model."""
    provider = {"api": "openai", "base_url": "http://x/v1", "cost_per_mtok_input": 0.40}
    return parse_config(
        {
            "models": [
                {
                    "name": LLAMA,
                    "tokenizer": "estimate:4",
                    "context_window": 32768,
                    "params_b": 8.03,
                    "kv": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2},
                },
                {"name": "long", "tokenizer": "estimate:4", "context_window": 1_000_000},
            ],
            "backends": [
                {
                    "name": "vllm",
                    "kind": "vllm",
                    "model": LLAMA,
                    "resources": {"num_gpus": 1},
                    "engine": {"max_num_seqs": 128, "max_model_len": 32768, **engine},
                },
                {
                    "name": "fallback",
                    "kind": "provider",
                    "model": LLAMA,
                    "provider": {**provider, "rpm": 5000, "tpm": 2_000_000, "cost_per_mtok_output": 1.6},
                },
                {
                    "name": "long-ctx",
                    "kind": "provider",
                    "model": "long",
                    "provider": {
                        **provider,
                        "rpm": 1000,
                        "tpm": 4_000_000,
                        "cost_per_mtok_cached_input": 0.10,
                        "cost_per_mtok_output": 1.60,
                    },
                },
            ],
            "surfaces": [
                {"name": "tab", "ttft_slo_ms": 100},
                {"name": "chat", "ttft_slo_ms": 1000},
                {"name": "agent", "ttft_slo_ms": 4000},
            ],
            "routes": [{"model": LLAMA, "candidates": ["vllm", "fallback"]}],
        }
    )


def demand(*routes: dict[str, Any], **top: Any) -> Demand:
    return parse_demand({"routes": list(routes), **top})


def route(**kw: Any) -> dict[str, Any]:
    return {
        "model": LLAMA,
        "surface": "chat",
        "peak_qps": 1,
        "input_tokens": 1000,
        "output_tokens": 200,
        **kw,
    }


# --- token distributions ---------------------------------------------------------------------


def test_token_distributions() -> None:
    const = TokenDist.model_validate(1000)
    assert (const.expected(), const.second_moment(), const.quantile(0.95)) == (1000, 1000**2, 1000)
    # p50 + p95: sigma = ln(p95/p50) / z95, mean = p50 * exp(sigma²/2).
    d = TokenDist(p50=800, p95=4000)
    sigma = math.log(5) / 1.6448536269514722
    assert d.lognormal()[1] == pytest.approx(sigma)
    assert d.expected() == pytest.approx(800 * math.exp(sigma**2 / 2))
    assert d.second_moment() == pytest.approx(d.expected() ** 2 * math.exp(sigma**2))
    # mean + p50: sigma² = 2 ln(mean/p50); a percentile given is used as is.
    d = TokenDist(mean=1200, p50=1000, p99=9000)
    assert d.quantile(0.99) == 9000
    assert TokenDist(mean=1200, p50=1000).lognormal()[1] == pytest.approx(math.sqrt(2 * math.log(1.2)))
    # mean + p95: the narrower of the two fitting log-normals.
    assert TokenDist(mean=40, p95=120).lognormal()[1] == pytest.approx(0.932, abs=1e-3)
    assert TokenDist(percentiles={50: 100, 90: 300, 99: 900}).expected() > 100


# --- hand-computed plans --------------------------------------------------------------------


def test_llama_8b_bf16_holds_128_kib_of_kv_per_token_and_fp8_half() -> None:
    p = plan(config(), demand(route()))
    h = p.routes[0].self_hosted
    assert h is not None
    assert h.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert h.kv_capacity_tokens == H100_KV_TOKENS
    assert h.kv_capacity_bytes == H100_KV_TOKENS * 128 * 1024
    cfg = config()
    assert cfg.models[0].kv is not None
    cfg.models[0].kv.dtype_bytes = 1  # an fp8 KV cache: half the bytes, twice the tokens
    h8 = plan(cfg, demand(route())).routes[0].self_hosted
    assert h8 is not None
    assert h8.kv_bytes_per_token == 64 * 1024
    assert h8.kv_capacity_tokens == pytest.approx(2 * H100_KV_TOKENS, abs=16)


def test_long_context_route_binds_on_tpm() -> None:
    # 0.5 QPS of 120k-token prompts: 30 req/min (3 % of 1,000 RPM) but 30 * (120,000 + 4,096)
    # = 3,722,880 tokens/min, 93 % of the 4M TPM cap.
    long = {"model": "long", "surface": "agent", "input_tokens": 120_000, "output_tokens": 800}
    r = plan(config(), demand({**long, "peak_qps": 0.5, "max_tokens": 4096, "cached_input_fraction": 0.5}))
    (rp,) = r.routes
    assert (rp.primary, rp.primary_kind, rp.binding, rp.self_hosted) == ("long-ctx", "provider", "TPM", None)
    (load,) = rp.providers
    assert load.tpm_needed == 30 * (120_000 + 4096) == 3_722_880
    assert load.tpm_utilization == pytest.approx(3_722_880 / 4e6)
    assert load.rpm_utilization == pytest.approx(30 / 1000)
    assert load.fits
    # Per request: 60k uncached * $0.40 + 60k cached * $0.10 + 800 out * $1.60, per 1M tokens.
    usd = (60_000 * 0.40 + 60_000 * 0.10 + 800 * 1.60) / 1e6
    assert load.usd_per_mtok == pytest.approx(usd / 120_800 * 1e6)
    assert load.usd_per_day == pytest.approx(usd * 0.5 * 86_400)
    # What-if +10 points of cache hits: 12k tokens per request move from $0.40 to $0.10.
    assert rp.what_if is not None
    assert rp.what_if.provider_usd_per_day_saved == pytest.approx(12_000 * 0.30 / 1e6 * 0.5 * 86_400)
    # Twice the load does not fit: a warning, and the plan says by how much.
    rp2 = plan(config(), demand({**long, "peak_qps": 1.0, "max_tokens": 4096})).routes[0]
    assert not rp2.providers[0].fits
    assert rp2.providers[0].tpm_utilization == pytest.approx(2 * 3_722_880 / 4e6)
    assert any("TPM cap" in w for w in rp2.warnings)


def test_many_tiny_requests_bind_on_rpm() -> None:
    long = {"model": "long", "surface": "chat", "input_tokens": 10, "output_tokens": 5}
    (load,) = plan(config(), demand({**long, "peak_qps": 100})).routes[0].providers
    assert (load.binding, load.rpm_utilization, load.tpm_utilization) == ("RPM", 6.0, 6000 * 15 / 4e6)


def test_self_hosted_route_binds_on_kv_memory() -> None:
    # 8k-token prompts, 400-token answers, loose objectives: a sequence holds on average
    # (8,000 + 399 * (8,000 + 400/2)) / 400 tokens, + half a 16-token block.
    agent = route(surface="agent", peak_qps=5, input_tokens=8000, output_tokens=400)
    p = plan(config(), demand(agent, headroom=0.0))
    h = p.routes[0].self_hosted
    assert h is not None
    per_seq = (8000 + 399 * (8000 + 400 / 2)) / 400 + 8
    assert h.kv_tokens_per_request == pytest.approx(per_seq)
    assert h.kv_bytes_per_request == pytest.approx(per_seq * 128 * 1024)
    assert (h.max_batch, h.max_batch_bound) == (int(H100_KV_TOKENS / per_seq), "KV memory")
    assert (h.batch, h.binding, p.routes[0].binding) == (h.max_batch, "KV memory", "KV memory")
    # Replicas: peak QPS over one replica's throughput at that batch; Little's law holds.
    assert h.replicas == pytest.approx(5 / h.requests_per_s_per_replica)
    assert h.peak_concurrency == pytest.approx(5 * h.latency_s)
    assert h.batch == pytest.approx(h.requests_per_s_per_replica * h.latency_s)
    (b,) = p.backends
    assert (b.replicas, b.gpus) == (math.ceil(h.replicas), math.ceil(h.replicas))
    assert b.usd_per_day == b.gpus * 2.5 * 24
    # More HBM per replica (H200) holds more sequences: the same route needs fewer GPUs.
    h200 = plan(config(), demand(agent, headroom=0.0, profiles={"vllm": "llama-3.1-8b-h200"}))
    assert h200.routes[0].self_hosted.max_batch > 2 * h.max_batch  # type: ignore[union-attr]


def test_itl_objective_binds_on_bandwidth() -> None:
    # Short, cached prompts and an 8 ms ITL objective: a decode step reads 16 GB of weights
    # (6.0 ms at 80 % of 3.35 TB/s) + 1 ms overhead + 128 KiB per context token, so the batch
    # stops where (16.06e9 + 131072 * B * ctx) / 2.68e12 + 1e-3 reaches 8 ms.
    r = route(peak_qps=50, input_tokens=200, output_tokens=200, cached_input_fraction=0.5, itl_slo_ms=8)
    h = plan(config(), demand(r)).routes[0].self_hosted
    assert h is not None
    assert (h.binding, h.slo_limit, h.step_regime) == ("bandwidth", "ITL", "bandwidth")
    ctx = 200 + 200 / 2
    by_hand = (8e-3 - 1e-3 - 8_030_261_248 * 2 / 2.68e12) * 2.68e12 / (131072 * ctx)
    assert h.batch == pytest.approx(by_hand, rel=0.2)
    assert h.itl_ms <= 8
    model = ReplicaModel(get_profile("llama-3.1-8b-h100"), Workload(400, 200, cached_fraction=0.5))
    assert model.itl(h.batch + 1) > 8e-3


def test_ttft_objective_binds_on_compute_and_tab_gets_smaller_batches_than_agent() -> None:
    # A 6k-token uncached prompt is ~6,000 * 2 * 8e9 / 700e12 = 138 ms of compute at batch 1.
    r = route(peak_qps=2, input_tokens=6000, output_tokens=300, ttft_slo_ms=400)
    h = plan(config(), demand(r)).routes[0].self_hosted
    assert h is not None
    assert (h.binding, h.slo_limit) == ("compute", "TTFT")
    assert 138 < h.ttft_p95_ms <= 400
    same = {"input_tokens": {"mean": 1500, "p95": 2500}, "output_tokens": 40, "cached_input_fraction": 0.7}
    p = plan(
        config(),
        demand(
            route(surface="tab", peak_qps=100, itl_slo_ms=20, **same),
            route(surface="agent", peak_qps=100, itl_slo_ms=60, **same),
        ),
    )
    tab, agent = (r.self_hosted for r in p.routes)
    assert tab is not None and agent is not None
    assert tab.batch < agent.batch
    assert tab.replicas > agent.replicas
    assert tab.ttft_p95_ms <= 100 and tab.itl_ms <= 20
    # The backend adds the routes' fractional replicas, then rounds up once.
    assert p.backends[0].replicas == math.ceil(tab.replicas + agent.replicas)


def test_unreachable_objective_is_reported_not_planned() -> None:
    r = route(peak_qps=1, input_tokens=8000, output_tokens=100, ttft_slo_ms=50)
    p = plan(config(), demand(r))
    h = p.routes[0].self_hosted
    assert h is not None
    assert not h.feasible and "misses the 50 ms objective" in h.reason
    assert p.backends[0].replicas == 0 and p.backends[0].unplanned_routes == [f"chat/{LLAMA}"]


def test_cost_and_cache_what_if() -> None:
    r = route(peak_qps=40, input_tokens={"mean": 3000, "p95": 8000}, output_tokens=100, ttft_slo_ms=300)
    p = plan(config(), demand(r, gpu_hourly_usd=4.0, cache_what_if_points=30))
    rp = p.routes[0]
    h, wi = rp.self_hosted, rp.what_if
    assert h is not None and wi is not None
    assert h.usd_per_day == pytest.approx(h.gpus * 4.0 * 24)
    assert h.usd_per_mtok == pytest.approx(h.usd_per_day / (40 * 86_400 * 3100) * 1e6)
    assert wi.cached_fraction == pytest.approx(0.3)
    assert wi.gpus_saved is not None and wi.gpus_saved > 0  # less prefill: a compute-bound route gains
    b = p.backends[0]
    assert b.what_if_gpus_saved == b.replicas - b.what_if_replicas  # type: ignore[operator]
    assert b.what_if_usd_per_day_saved == b.what_if_gpus_saved * 4.0 * 24  # type: ignore[operator]
    fallback = rp.providers[0]
    assert fallback.backend == "fallback"
    assert fallback.usd_per_mtok == pytest.approx((3000 * 0.40 + 100 * 1.6) / 3100)


def test_profile_mapping() -> None:
    cfg = config()
    assert backend_profile(cfg, cfg.backend("vllm"), demand(route())).name == "llama-3.1-8b-h100"
    named = demand(route(), profiles={"vllm": "llama-3.1-8b-h200"})
    p = backend_profile(cfg, cfg.backend("vllm"), named)
    assert (p.name, p.engine.max_num_seqs, p.max_model_len()) == ("llama-3.1-8b-h200", 128, 32768)
    tp = config(tensor_parallel_size=2)
    with pytest.raises(DemandError, match=r"profiles\.vllm: no engine profile matches"):
        backend_profile(tp, tp.backend("vllm"), demand(route()))
    local = parse_config(yaml.safe_load((ROOT / "configs/local.yaml").read_text()))
    tiny = backend_profile(local, local.backends[0], parse_demand({"routes": [route(model="tiny-llama")]}))
    assert (tiny.name, tiny.engine.block_size, tiny.engine.max_num_seqs) == ("cpu-tiny", 32, 32)


# --- bad demand files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"routes": [route(input_tokns=5)]}, "routes.0.input_tokns"),
        ({"routes": [route(peak_qps=-1)]}, "routes.0.peak_qps"),
        ({"routes": [route(input_tokens={"p50": 900, "p95": 100})]}, "routes.0.input_tokens"),
        ({"routes": [route(input_tokens={"percentiles": {120: 5}})]}, "routes.0.input_tokens.percentiles"),
        ({"routes": [route(cached_input_fraction=1.5)]}, "routes.0.cached_input_fraction"),
        ({"routes": [route(shared_prefix_tokens=500)]}, "shared_prefix_tokens"),
        ({"routes": [route()], "profiles": {"vllm": "nope"}}, "profiles"),
        ({"routes": []}, "routes"),
    ],
)
def test_bad_demand_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(DemandError) as info:
        parse_demand(raw, source="bad.yaml")
    assert field in str(info.value) and "bad.yaml" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"routes": [route(peak_qps=1, model="gpt-9")]}, "routes[0].model: unknown model 'gpt-9'"),
        ({"routes": [route(peak_qps=1, surface="ide")]}, "routes[0].surface"),
        ({"routes": [route(peak_qps=1, backend="long-ctx")]}, "routes[0].backend"),
        ({"routes": [route(peak_qps=1), route(peak_qps=2)]}, "routes[1]"),
        ({"routes": [route(peak_qps=1)], "profiles": {"fallback": "cpu-tiny"}}, "profiles.fallback"),
    ],
)
def test_demand_that_does_not_match_the_config_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(DemandError) as info:
        plan(config(), parse_demand(raw))
    assert field in str(info.value)


def test_every_demand_field_is_described() -> None:
    from cluster.planner import demand

    for cls in (demand.TokenDist, demand.RouteDemand, demand.Demand):
        assert cls.model_config.get("extra") == "forbid"
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"


# --- the CLI -------------------------------------------------------------------------------


def _write_cluster(tmp_path: Path) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(config().model_dump(mode="json", exclude_none=True)))
    return p


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_cluster(tmp_path)
    d = tmp_path / "demand.yaml"
    d.write_text(yaml.safe_dump({"routes": [route(peak_qps=10), {**route(peak_qps=0.2), "model": "long"}]}))
    assert cli_main(["plan", "--config", str(cfg), "--demand", str(d)]) == 0
    out = capsys.readouterr().out
    for text in ("Demand at peak", "Self-hosted", "Providers", "Per backend", "Total:", "chat/long"):
        assert text in out
    assert cli_main(["plan", "--config", str(cfg), "--demand", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"routes", "backends", "providers", "totals", "assumptions"} <= set(data)
    assert data["routes"][0]["self_hosted"]["kv_bytes_per_token"] == 131072


def test_cli_bad_demand_exits_2_naming_the_field(tmp_path: Path) -> None:
    cfg = _write_cluster(tmp_path)
    d = tmp_path / "demand.yaml"
    d.write_text(yaml.safe_dump({"routes": [route(peak_qps="lots")]}))
    r = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "plan", "--config", str(cfg), "--demand", str(d)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert "routes.0.peak_qps" in r.stderr and str(d) in r.stderr


@pytest.mark.skipif(not (ROOT / "configs/gpu.yaml").exists(), reason="configs/gpu.yaml is not there")
def test_shipped_example_plans_against_gpu_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--config",
        str(ROOT / "configs/gpu.yaml"),
        "--demand",
        str(ROOT / "configs/demand-example.yaml"),
    ]
    assert cli_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    bindings = {r["binding"] for r in data["routes"]}
    assert "TPM" in bindings and "KV memory" in bindings
    assert data["totals"]["gpus"] > 0
