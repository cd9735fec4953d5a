"""The engine arguments a backend sets (``backends[].engine``): the vLLM engine's, which the simulated
engine and the capacity planner read too, and how a vLLM replica's processes share the host's CPU."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.base import Strict
from cluster.engine.warmup import WarmupConfig
from cluster.json_types import JSONObject


class EngineArgs(Strict):
    """The vLLM engine arguments we set; anything else goes through ``extra``."""

    block_size: int | None = Field(None, gt=0, description="KV block size in tokens (CPU: a multiple of 32).")
    max_num_seqs: int | None = Field(None, gt=0, description="Maximum sequences in one batch.")
    max_model_len: int | None = Field(
        None, gt=0, description="Engine context length (defaults to the model's)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV cache size; overrides the GPU share."
    )
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="GPU memory share for vLLM.")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per replica.")
    enforce_eager: bool = Field(
        False, description="Skip graph capture/compilation (faster start, slower run)."
    )
    enable_prefix_caching: bool = Field(True, description="Keep the prefix cache on: routing depends on it.")
    max_num_batched_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "Token budget of one engine step, i.e. the chunked-prefill size (None: the engine's default). "
            "One step cannot hold a Tab token longer than this many prompt tokens take to compute."
        ),
    )
    scheduling_policy: Literal["priority", "fcfs"] = Field(
        "priority",
        description=(
            "Engine queue order: 'priority' (each request carries its surface's priority, lower first, "
            "then the gateway's cache rank, cached contexts first; lower-priority running work preempted "
            "first under KV pressure) or vLLM's 'fcfs'."
        ),
    )
    cpu_nice: int = Field(
        0,
        ge=0,
        le=19,
        description=(
            "Added to a vLLM replica's niceness before its engine starts (Ray starts every worker at "
            "15 and the kernel stops at 19). On a host the engines share with the gateway (a local CPU "
            "cluster), the kernel then runs the gateway first. 0: unchanged."
        ),
    )
    cpu_sched: Literal["normal", "idle", "auto"] = Field(
        "normal", description="A vLLM engine core's Linux scheduling class: cluster/policy/cpu_class.py"
    )
    warmup: WarmupConfig = Field(
        default_factory=WarmupConfig,
        description="What a replica runs before it takes traffic (cluster/engine/warmup.py).",
    )
    extra: JSONObject = Field(default_factory=dict, description="Further AsyncEngineArgs, passed as is.")

    @model_validator(mode="after")
    def _no_shadowed_extra(self) -> EngineArgs:
        for key in ("max_num_batched_tokens", "scheduling_policy"):
            if key in self.extra:
                raise ValueError(f"extra.{key}: set engine.{key} instead (the sim and the planner read it)")
        return self
