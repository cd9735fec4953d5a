"""A simulated engine's profile with a linear step-time model, for tests that need exact timings."""

from __future__ import annotations

from cluster.engine.profiles import TINY_LLAMA, EngineSpec, FittedCoefficients, Profile

# The engine's size unless a test says otherwise: KV blocks, tokens per block, the chunked-prefill
# step, running sequences, the longest sequence.
ENGINE = {"num_blocks": 64, "block_size": 4, "budget": 256, "max_num_seqs": 16, "max_model_len": 64}


def linear_profile(fitted: FittedCoefficients, step_overhead_s: float, **engine: int) -> Profile:
    """TINY_LLAMA whose every step costs ``fitted``'s terms plus ``step_overhead_s``, on an engine
    of :data:`ENGINE`'s size with ``engine``'s changes."""
    e = ENGINE | engine
    return Profile(
        name="test",
        model=TINY_LLAMA,
        fitted=fitted,
        engine=EngineSpec(
            block_size=e["block_size"],
            max_num_seqs=e["max_num_seqs"],
            max_num_batched_tokens=e["budget"],
            max_model_len=e["max_model_len"],
            kv_cache_bytes=e["num_blocks"] * e["block_size"] * TINY_LLAMA.kv_bytes_per_token(),
            step_overhead_s=step_overhead_s,
        ),
    )
