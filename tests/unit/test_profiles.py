"""Profiles: registry, KV capacity arithmetic, step-time models."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from cluster.engine import profiles as P
from cluster.engine.profiles import (
    PROFILES,
    BatchShape,
    EngineSpec,
    FittedCoefficients,
    GiB,
    LinearStepTime,
    Profile,
    RooflineStepTime,
    get_profile,
)


def test_registry_has_the_shipped_profiles() -> None:
    assert {"llama-3.1-8b-h100", "llama-3.1-8b-h200", "llama-3.1-70b-h100-tp4", "cpu-tiny"} <= set(PROFILES)
    for name, profile in PROFILES.items():
        assert profile.name == name
        assert profile.num_kv_blocks() * profile.engine.block_size >= profile.max_model_len()
    with pytest.raises(KeyError, match="unknown sim profile 'nope'"):
        get_profile("nope")


@pytest.mark.parametrize("cls", [P.ModelSpec, P.GPUSpec, P.EngineSpec, P.FittedCoefficients, P.Profile])
def test_every_field_is_described_and_extra_is_forbidden(cls: type[BaseModel]) -> None:
    for name, f in cls.model_fields.items():
        assert f.description, f"{cls.__name__}.{name} has no description"
    assert cls.model_config.get("extra") == "forbid"


def test_kv_bytes_per_token() -> None:
    assert P.LLAMA_31_8B.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert P.LLAMA_31_70B.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2
    assert P.LLAMA_31_70B.kv_bytes_per_token(tp=4) == 2 * 80 * 2 * 128 * 2  # 2 KV heads per GPU
    assert P.LLAMA_31_70B.kv_bytes_per_token(tp=16) == 2 * 80 * 1 * 128 * 2  # replicated, not split
    assert P.TINY_LLAMA.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 2 == 512


def test_kv_capacity_is_hbm_share_minus_weights_over_block_bytes() -> None:
    p = get_profile("llama-3.1-8b-h100")
    free = 80e9 * 0.9 - 8_030_261_248 * 2 - 2 * GiB
    assert p.num_kv_blocks() == int(free) // (128 * 1024 * 16)
    p70 = get_profile("llama-3.1-70b-h100-tp4")
    free70 = 80e9 * 0.9 - 70_553_706_496 * 2 / 4 - 3 * GiB
    assert p70.num_kv_blocks() == int(free70) // (81920 * 16)
    # The H200 holds more than twice the H100's KV for the same model.
    assert get_profile("llama-3.1-8b-h200").num_kv_blocks() > 2 * p.num_kv_blocks()
    # An explicit KV size wins over the HBM share (vLLM kv_cache_memory_bytes).
    assert p.with_engine(kv_cache_bytes=64 * 2**20).num_kv_blocks() == 64 * 2**20 // (128 * 1024 * 16)
    assert get_profile("cpu-tiny").num_kv_blocks() == 64 * 2**20 // (512 * 128)


def test_weights_that_do_not_fit_are_an_error() -> None:
    p = get_profile("llama-3.1-70b-h100-tp4").with_engine(tensor_parallel_size=1)
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        p.num_kv_blocks()


def test_profile_validation() -> None:
    base = get_profile("llama-3.1-8b-h100")
    with pytest.raises(ValidationError, match="exactly one"):
        Profile(
            name="x",
            model=base.model,
            gpu=base.gpu,
            fitted=FittedCoefficients(prefill_s_per_token=0, decode_base_s=0, decode_s_per_seq=0),
        )
    with pytest.raises(ValidationError, match="kv_cache_bytes"):
        Profile(
            name="x",
            model=base.model,
            fitted=FittedCoefficients(prefill_s_per_token=0, decode_base_s=0, decode_s_per_seq=0),
        )
    with pytest.raises(ValidationError, match="block_sise"):
        EngineSpec.model_validate({"block_sise": 16})
    with pytest.raises(ValidationError):
        base.with_engine(block_size=0)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    p = get_profile("llama-3.1-8b-h100")
    m = p.step_time_model()
    assert isinstance(m, RooflineStepTime)
    bw = 3.35e12 * 0.8
    one = m.step_time(BatchShape(decode_tokens=1, kv_read_tokens=1000))
    assert one == pytest.approx((8_030_261_248 * 2 + 1000 * 131072) / bw + 1e-3)
    n = 4096
    pre = m.step_time(BatchShape(prefill_tokens=n, kv_read_tokens=n, attn_pairs=n * (n + 1) // 2))
    flops = 2 * 8_030_261_248 * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert pre == pytest.approx(flops / 700e12 + 1e-3)
    # Bigger batches read more KV: the step grows with batch size even when memory bound.
    assert m.step_time(BatchShape(decode_tokens=64, kv_read_tokens=64_000)) > one
    # The H200's bandwidth makes decode faster; prefill (compute) is the same.
    m200 = get_profile("llama-3.1-8b-h200").step_time_model()
    assert m200.step_time(BatchShape(decode_tokens=1, kv_read_tokens=1000)) < one


def test_tensor_parallel_splits_weights_and_flops() -> None:
    m = get_profile("llama-3.1-70b-h100-tp4").step_time_model()
    assert isinstance(m, RooflineStepTime)
    assert m.weight_bytes == pytest.approx(70_553_706_496 * 2 / 4)
    assert m.flops_per_token == pytest.approx(2 * 70_553_706_496 / 4)


def test_linear_step_time() -> None:
    m = get_profile("cpu-tiny").step_time_model()
    assert isinstance(m, LinearStepTime)
    lin = LinearStepTime(
        prefill_s_per_token=1e-3,
        decode_base_s=5e-3,
        decode_s_per_seq=2e-3,
        kv_s_per_token=1e-6,
        overhead_s=1e-2,
    )
    assert lin.step_time(BatchShape(prefill_tokens=10)) == pytest.approx(1e-2 + 1e-2)
    assert lin.step_time(BatchShape(decode_tokens=3, kv_read_tokens=100)) == pytest.approx(
        1e-2 + 5e-3 + 6e-3 + 1e-4
    )
