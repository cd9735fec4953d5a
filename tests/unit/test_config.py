"""Config validation: the shipped configs load; bad files fail with a message naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


CLUSTER_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("demand"))


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path)
    for m in cfg.models:
        for s in cfg.surfaces:
            assert cfg.candidates(m.name, s.name), f"{path.name}: no backend for {m.name}/{s.name}"


def _base() -> dict:
    return yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c["models"][0].update(context_window=0), "models.0.context_window"),
        (lambda c: c["models"][0].update(contxt_window=5), "models.0.contxt_window"),
        (lambda c: c["backends"][0].update(kind="tpu"), "backends.0.kind"),
        (lambda c: c["backends"][0].update(model="nope"), "backends[0].model"),
        (lambda c: c["routes"][0].update(candidates=["ghost"]), "routes[0].candidates"),
        (lambda c: c["surfaces"].append(dict(c["surfaces"][0])), "surfaces: duplicate name 'tab'"),
        (lambda c: c["server"].update(default_surface="nope"), "server.default_surface"),
        (lambda c: c["server"].update(port="eighty"), "server.port"),
        (lambda c: c.update(extra_section=1), "extra_section"),
        (lambda c: c["backends"][0].update(kind="provider"), "provider"),
        (
            lambda c: c["backends"][0].update(affinity={"new_prefix": "random"}),
            "backends.0.affinity.new_prefix",
        ),
        (
            lambda c: c["backends"][0].update(affinity={"min_match_ratio": 2}),
            "backends.0.affinity.min_match_ratio",
        ),
        (lambda c: c["backends"][0]["engine"].update(cpu_nice=20), "backends.0.engine.cpu_nice"),
        (lambda c: c["backends"][0]["engine"].update(cpu_nice=-1), "backends.0.engine.cpu_nice"),
        (lambda c: c["backends"][0]["engine"].update(cpu_sched="fast"), "backends.0.engine.cpu_sched"),
    ],
)
def test_bad_config_names_the_field(mutate, field: str) -> None:
    raw = _base()
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="bad.yaml")
    assert field in str(info.value)
    assert "bad.yaml" in str(info.value)


def test_output_limits_default_to_none_and_old_files_keep_loading() -> None:
    raw = _base()
    raw["models"][0].pop("default_max_tokens", None)
    cfg = parse_config(raw)
    assert cfg.models[0].default_max_tokens is None  # the rest of the window, as OpenAI and vLLM
    assert all(s.max_output_tokens is None for s in cfg.surfaces)
    raw["models"][0]["default_max_tokens"] = 64  # a file written before the window default
    raw["surfaces"][0]["max_output_tokens"] = 128
    cfg = parse_config(raw)
    assert cfg.models[0].default_max_tokens == 64 and cfg.surfaces[0].max_output_tokens == 128
    raw["surfaces"][0]["max_output_tokens"] = 0
    with pytest.raises(ConfigError, match=r"surfaces\.0\.max_output_tokens"):
        parse_config(raw)


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_config([1, 2])
    p = tmp_path / "broken.yaml"
    p.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_cli_check_exits_nonzero_naming_the_field(tmp_path: Path) -> None:
    raw = _base()
    raw["surfaces"][0]["ttft_slo_ms"] = -1
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    r = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "check", "--config", str(p)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "surfaces.0.ttft_slo_ms" in r.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "check", "--config", str(ROOT / "configs/local.yaml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr


def test_affinity_config_reaches_the_policy() -> None:
    from cluster.routing.affinity import AffinityParams

    raw = _base()
    raw["backends"][0]["affinity"] = {"min_match_tokens": 128, "load_factor": 2.0, "new_prefix": "rendezvous"}
    b = parse_config(raw).backends[0]
    p = AffinityParams(**b.affinity.params())
    assert (p.min_match_tokens, p.load_factor, p.new_prefix, p.min_match_ratio) == (
        128,
        2.0,
        "rendezvous",
        0.5,
    )
    assert b.affinity.kv_events  # on unless the config says otherwise


def test_home_placement_is_config() -> None:
    from cluster.routing.affinity import AffinityParams

    raw = _base()
    raw["backends"][0]["affinity"] = {"new_prefix": "home", "home_half_life_requests": 64}
    p = AffinityParams(**parse_config(raw).backends[0].affinity.params())
    assert (p.new_prefix, p.home_half_life_requests) == ("home", 64)
    raw["backends"][0]["affinity"] = {"new_prefix": "home", "home_half_life_requests": 0}
    with pytest.raises(ConfigError, match="home_half_life_requests"):
        parse_config(raw)


def test_candidates_prefer_surface_specific_routes() -> None:
    raw = _base()
    raw["backends"].append({"name": "vllm-b", "kind": "vllm", "model": "tiny-llama"})
    raw["routes"] = [
        {"model": "tiny-llama", "candidates": ["vllm-tiny", "vllm-b"]},
        {"model": "tiny-llama", "surface": "tab", "candidates": ["vllm-b"]},
    ]
    cfg = parse_config(raw)
    assert cfg.candidates("tiny-llama", "tab") == ["vllm-b"]
    assert cfg.candidates("tiny-llama", "chat") == ["vllm-tiny", "vllm-b"]


def test_kv_bytes_per_token_llama_8b() -> None:
    from cluster.config import KVGeometry

    # Llama-3.1-8B bf16: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB.
    assert KVGeometry(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2).bytes_per_token() == 128 * 1024


def test_kv_indexers_need_the_events_and_a_placement_they_mirror() -> None:
    """Issue 42's indexer (affinity.kv_index: indexer) applies the engines' KV events and mirrors
    the index and the homes: without events, or with least_loaded's last-stored map, a clear error."""
    from cluster.config import AffinityConfig

    assert AffinityConfig(kv_index="indexer", indexer_shards=4).params().get("kv_index") is None
    with pytest.raises(ValueError, match="needs kv_events"):
        AffinityConfig(kv_index="indexer", kv_events=False)
    with pytest.raises(ValueError, match="least_loaded"):
        AffinityConfig(kv_index="indexer", new_prefix="least_loaded")
    with pytest.raises(ValueError):
        AffinityConfig(kv_index="indexer", indexer_shards=0)
