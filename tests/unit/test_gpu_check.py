"""scripts/gpu-check.sh on CPU: its config for a GPU, the model shapes, and the dry run (everything
up to the point where a GPU is needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.engine.tiny_model import GEOMETRY, SHAPES, kv_geometry, llama_config, param_count
from loadtest.benchmarks.gpu_check import affinity_variants, gpu_config, plan_replicas

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_param_count_is_the_models(shape: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape)
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(cfg)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    assert kv_geometry("tiny") == GEOMETRY


def test_two_replicas_on_a_big_gpu_one_on_a_small_one() -> None:
    assert plan_replicas(141, "gpu-1b") == 2  # H200
    assert plan_replicas(80, "gpu-1b") == 2  # H100: 36 GiB each, 1.4 GiB of weights
    assert plan_replicas(16, "gpu-1b") == 1


def test_gpu_config_is_a_valid_cluster_config() -> None:
    doc = gpu_config("/models/gpu-1b", 141)
    cfg = ClusterConfig.model_validate(yaml.safe_load(yaml.safe_dump(doc)))
    (b,) = cfg.backends
    assert b.kind == "vllm" and b.replicas == 2 and b.resources.num_gpus == 0.5
    assert b.engine.gpu_memory_utilization == pytest.approx(0.45)
    m = cfg.model(b.model)
    assert m is not None and m.path == m.tokenizer == "/models/gpu-1b"
    assert m.kv.model_dump() == kv_geometry("gpu-1b") and b.engine.max_model_len == m.context_window
    one = ClusterConfig.model_validate(gpu_config("/m", 16))
    assert one.backends[0].replicas == 1 and one.backends[0].engine.gpu_memory_utilization == 0.9
    v = affinity_variants("c.yaml")["variants"]
    assert [x["name"] for x in v] == ["cache_aware", "round_robin"]
    assert v[1]["set"] == {"backends.0.routing": "round_robin"}


def test_dry_run_on_cpu(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LLMC_VENV": str(Path(sys.executable).parent.parent),
        "LLMC_GPU_CHECK_DIR": str(tmp_path / "work"),
        "LLMC_GPU_CHECK_RESULTS": str(tmp_path / "results"),
    }
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = ClusterConfig.model_validate(yaml.safe_load((tmp_path / "work/gpu-check.yaml").read_text()))
    assert cfg.backends[0].replicas == 2
    assert "would run:" in r.stdout and "--vllm-config" in r.stdout and "gpu_affinity" in r.stdout
    variants = yaml.safe_load((tmp_path / "work/variants.yaml").read_text())
    assert variants["variants"][0]["config"] == str(tmp_path / "work/gpu-check.yaml")
    assert not list((tmp_path / "results").iterdir())  # nothing measured, nothing written
