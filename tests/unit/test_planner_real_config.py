"""The real planner validation's deployment config (loadtest/benchmarks/planner_real.py): the host's CPU
costs come from a calibration of this machine when one is given, else from configs/local.yaml."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.benchmarks.planner_real import KV_BYTES, real_config


def test_host_costs_come_from_the_calibration_given(tmp_path: Path) -> None:
    own = real_config()
    vllm = next(b for b in own.backends if b.kind == "vllm")
    assert vllm.host_cpu is not None and vllm.engine.kv_cache_memory_bytes == KV_BYTES
    coefficients = {
        "engine_cores_per_step": 1.234,
        "background_cores": 0.321,
        "serving_cpu_ms_per_token": 0.0555,
        "serving_cpu_ms_per_request": 2.222,
    }
    path = tmp_path / "host_cpu.json"
    path.write_text(json.dumps({"coefficients": coefficients, "provenance": {"git_commit": "abcdef123"}}))
    cfg = real_config(host_calibration=path)
    host = next(b for b in cfg.backends if b.kind == "vllm").host_cpu
    assert host is not None
    assert host.model_dump(include=set(coefficients)) == coefficients
    assert host.cores == vllm.host_cpu.cores  # the box's size stays the config's
    assert host.measured is not None and "abcdef1" in host.measured and str(path) in host.measured
    assert vllm.host_cpu.engine_cores_per_step != coefficients["engine_cores_per_step"]
