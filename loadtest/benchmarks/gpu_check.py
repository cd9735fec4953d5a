"""The pieces of ``scripts/gpu-check.sh`` that are Python: the GPU's memory, the cluster config for
it, and the affinity benchmark's variants.

    python -m loadtest.benchmarks.gpu_check gpu-memory              # GiB of GPU 0 (nvidia-smi), or exit 1
    python -m loadtest.benchmarks.gpu_check config --model DIR --gpu-gib 141 --out work/gpu-check.yaml
    python -m loadtest.benchmarks.gpu_check variants --config work/gpu-check.yaml --out work/variants.yaml

The config serves a random-weight Llama (``cluster.engine.tiny_model --shape gpu-1b``) on vLLM GPU
replicas: two on one GPU when each half holds the weights and a useful KV cache, else one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from cluster.engine.tiny_model import SHAPES, kv_geometry, param_count

MIN_KV_GIB = 8.0  # below this per replica, one replica gets the whole GPU
GPU_MEMORY_SHARE = 0.9  # of the GPU, split between the replicas (vLLM's gpu_memory_utilization)


def plan_replicas(gpu_gib: float, shape: str) -> int:
    """Two replicas on one GPU when each one's share holds the weights and MIN_KV_GIB of KV."""
    weights_gib = 2 * param_count(shape) / 2**30  # bf16
    per_replica = GPU_MEMORY_SHARE * gpu_gib / 2
    return 2 if per_replica - weights_gib - 2.0 >= MIN_KV_GIB else 1  # 2 GiB: activations, graphs


def gpu_config(model_dir: str, gpu_gib: float, shape: str = "gpu-1b") -> dict[str, Any]:
    """A cluster config (the YAML's dict) for this GPU: one vLLM backend, loopback, no auth."""
    replicas = plan_replicas(gpu_gib, shape)
    positions = SHAPES[shape]["positions"]
    engine = {
        "block_size": 16,
        "max_num_seqs": 128,
        "max_model_len": positions,
        "gpu_memory_utilization": round(GPU_MEMORY_SHARE / replicas, 3),
        "enable_prefix_caching": True,
        "enforce_eager": False,
    }
    surfaces = [
        {"name": "tab", "priority": 0, "ttft_slo_ms": 100, "max_concurrency": 128, "max_queue": 256,
         "queue_deadline_ms": 250, "request_timeout_s": 60},
        {"name": "chat", "priority": 1, "ttft_slo_ms": 1000, "max_concurrency": 256, "max_queue": 512,
         "queue_deadline_ms": 2000},
        {"name": "agent", "priority": 2, "ttft_slo_ms": 3000, "max_concurrency": 64, "max_queue": 256,
         "queue_deadline_ms": 5000},
    ]  # fmt: skip
    return {
        "name": "llm-cluster-gpu-check",
        "server": {"host": "127.0.0.1", "port": 8000, "metrics_port": 8080, "default_surface": "chat"},
        "models": [
            {
                "name": "gpu-llama-1b",
                "tokenizer": model_dir,
                "path": model_dir,
                "context_window": positions,
                "default_max_tokens": 128,
                "params_b": round(param_count(shape) / 1e9, 3),
                "kv": kv_geometry(shape),
            }
        ],
        "backends": [
            {
                "name": "vllm-gpu",
                "kind": "vllm",
                "model": "gpu-llama-1b",
                "replicas": replicas,
                "resources": {"num_cpus": 2, "num_gpus": round(1 / replicas, 3)},
                "max_in_flight_per_replica": 192,
                "engine": engine,
            }
        ],
        "surfaces": surfaces,
        "routes": [{"model": "gpu-llama-1b", "candidates": ["vllm-gpu"]}],
    }


def affinity_variants(config_path: str) -> dict[str, Any]:
    """``cluster bench --variants``: the same engines with our cache-aware routing and round robin."""
    return {
        "variants": [
            {"name": "cache_aware", "config": config_path},
            {"name": "round_robin", "config": config_path, "set": {"backends.0.routing": "round_robin"}},
        ]
    }


def gpu_memory_gib() -> float:
    """Total memory of GPU 0 in GiB, from nvidia-smi (raises when there is no GPU)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return float(out.strip().splitlines()[0]) / 1024  # MiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("gpu-memory", help="print GPU 0's memory in GiB")
    c = sub.add_parser("config", help="write the cluster config for this GPU")
    c.add_argument("--model", required=True, help="the random-weight model's folder")
    c.add_argument("--gpu-gib", type=float, required=True)
    c.add_argument("--shape", default="gpu-1b", choices=sorted(SHAPES))
    c.add_argument("--out", type=Path, required=True)
    v = sub.add_parser("variants", help="write the affinity benchmark's variants file")
    v.add_argument("--config", required=True)
    v.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "gpu-memory":
        try:
            print(f"{gpu_memory_gib():.1f}")
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            print(f"no NVIDIA GPU visible: {exc}", file=sys.stderr)
            return 1
        return 0
    doc = gpu_config(args.model, args.gpu_gib, args.shape) if args.cmd == "config" else None
    doc = doc or affinity_variants(args.config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(yaml.safe_dump(doc, sort_keys=False))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
