"""The simulated engine's knobs (``BackendConfig.sim_options``): its speed and the faults and latency
it injects. Typed in the config itself, so a bad knob fails ``cluster check`` naming it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SimOptions(BaseModel):
    """``BackendConfig.sim_options``, validated."""

    model_config = ConfigDict(extra="forbid")

    speedup: float = Field(1.0, gt=0, description="Simulated seconds per real second (1: real time).")
    extra_latency_s: float = Field(0.0, ge=0, description="Delay added before the first token (sim seconds).")
    extra_latency_fraction: float = Field(
        0.0, ge=0, le=1, description="Share of requests that get extra_latency_s."
    )
    error_rate: float = Field(
        0.0, ge=0, le=1, description="Share of requests failing before the first token."
    )
    stall_after_tokens: int | None = Field(
        None, ge=0, description="Every stream goes silent after this many tokens (None: never)."
    )
    dead: bool = Field(False, description="Every call raises BackendUnavailable.")
    eos_probability: float = Field(
        0.0, ge=0, lt=1, description="Chance each token is EOS (geometric lengths); 0: always max_tokens."
    )
    seed: int | None = Field(
        None, description="Seed of the fault draws, mixed with the replica's id (None: random)."
    )
