"""The capacity planner's input: the demand file (peak requests per (model, surface), prompt and
output length distributions, cached share, objectives, GPU prices), validated like the config.
Pure: YAML in, a :class:`Demand` out; :mod:`cluster.planner.capacity` plans against it."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from statistics import NormalDist

from pydantic import Field, ValidationInfo, field_validator, model_validator

from cluster.base import ConfigError, Strict, read_yaml, validate
from cluster.engine.profiles import PROFILES
from cluster.json_types import JSON, JSONObject


class TokenDist(Strict):
    """A token-count distribution: a mean, percentiles, or both (a bare number is a constant).

    With two or more percentiles (or a mean and one percentile) a log-normal is fitted; it gives
    the mean when none is given, the second moment and any percentile not given."""

    mean: float | None = Field(None, ge=0, description="Mean tokens per request.")
    p50: float | None = Field(None, ge=0, description="Median tokens per request.")
    p90: float | None = Field(None, ge=0, description="90th percentile.")
    p95: float | None = Field(None, ge=0, description="95th percentile.")
    p99: float | None = Field(None, ge=0, description="99th percentile.")
    percentiles: dict[float, float] = Field(
        default_factory=dict, description="More percentiles, {percent: tokens}, e.g. {75: 900, 99.9: 30000}."
    )

    @model_validator(mode="before")
    @classmethod
    def _number_is_constant(cls, data: JSON) -> JSON:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"mean": data}
        return data

    @field_validator("percentiles")
    @classmethod
    def _percent_range(cls, v: dict[float, float]) -> dict[float, float]:
        for p, tokens in v.items():
            if not 0 < p < 100:
                raise ValueError(f"percentile {p:g} is not strictly between 0 and 100")
            if tokens < 0:
                raise ValueError(f"percentile {p:g}: tokens must be >= 0")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TokenDist:
        points = self.points()
        if self.mean is None and not points:
            raise ValueError("give a mean or at least one percentile")
        for (p1, v1), (p2, v2) in itertools.pairwise(points):
            if v2 < v1:
                raise ValueError(f"percentiles decrease: p{p1 * 100:g}={v1:g} > p{p2 * 100:g}={v2:g}")
        return self

    def points(self) -> list[tuple[float, float]]:
        """(probability, tokens), sorted by probability."""
        named = {0.5: self.p50, 0.9: self.p90, 0.95: self.p95, 0.99: self.p99}
        pts = {p: v for p, v in named.items() if v is not None}
        pts.update({p / 100: v for p, v in self.percentiles.items()})
        return sorted(pts.items())

    def lognormal(self) -> tuple[float, float]:
        """(mu, sigma) of ln(tokens); sigma 0 for a constant."""
        pts = [(NormalDist().inv_cdf(p), math.log(v)) for p, v in self.points() if v > 0]
        if len(pts) >= 2:
            n = len(pts)
            zm = sum(z for z, _ in pts) / n
            ym = sum(y for _, y in pts) / n
            szz = sum((z - zm) ** 2 for z, _ in pts)
            sigma = max(0.0, sum((z - zm) * (y - ym) for z, y in pts) / szz)
            return ym - sigma * zm, sigma
        if len(pts) == 1:
            z, y = pts[0]
            if self.mean is None or self.mean <= 0:
                return y, 0.0
            # ln(mean) = mu + sigma²/2 and y = mu + sigma·z  =>  sigma²/2 - z·sigma - ln(mean/q) = 0
            disc = z * z + 2 * (math.log(self.mean) - y)
            if disc < 0:
                return y, 0.0
            roots = [r for r in (z - math.sqrt(disc), z + math.sqrt(disc)) if r >= 0]
            sigma = min(roots)  # the narrower of the two log-normals that fit
            return y - sigma * z, sigma
        return (math.log(self.mean) if self.mean else 0.0), 0.0

    def expected(self) -> float:
        if self.mean is not None:
            return self.mean
        mu, sigma = self.lognormal()
        return math.exp(mu + sigma * sigma / 2)

    def second_moment(self) -> float:
        """E[tokens²] (a constant's square when nothing tells the spread)."""
        return self.expected() ** 2 * math.exp(self.lognormal()[1] ** 2)

    def quantile(self, p: float) -> float:
        for q, v in self.points():
            if abs(q - p) < 1e-9:
                return v
        mu, sigma = self.lognormal()
        if sigma == 0:
            return self.expected()
        return math.exp(mu + sigma * NormalDist().inv_cdf(p))


class RouteDemand(Strict):
    model: str = Field(description="Model id (from the config's models).")
    surface: str = Field(description="Surface (from the config's surfaces).")
    peak_qps: float = Field(gt=0, description="Peak requests per second.")
    input_tokens: TokenDist = Field(description="Prompt tokens per request (cached ones included).")
    output_tokens: TokenDist = Field(description="Generated tokens per request.")
    cached_input_fraction: float | None = Field(
        None, ge=0, lt=1, description="Share of input tokens served from the prefix cache (hit rate)."
    )
    cached_input_tokens: TokenDist | None = Field(
        None, description="Cached input tokens per request (instead of cached_input_fraction)."
    )
    shared_prefix_tokens: int = Field(
        0, ge=0, description="Cached tokens identical across requests (system prompt): KV held once."
    )
    max_tokens: int | None = Field(
        None, gt=0, description="max_tokens clients send; providers count input + max_tokens in TPM."
    )
    ttft_slo_ms: float | None = Field(None, gt=0, description="p95 TTFT objective (default: the surface's).")
    itl_slo_ms: float | None = Field(None, gt=0, description="Mean inter-token latency objective (none).")
    backend: str | None = Field(
        None, description="Backend to plan on (default: the route's first candidate)."
    )

    @model_validator(mode="after")
    def _cache(self) -> RouteDemand:
        if self.cached_input_fraction is not None and self.cached_input_tokens is not None:
            raise ValueError("give cached_input_fraction or cached_input_tokens, not both")
        if self.cached_input_tokens is not None and (
            self.cached_input_tokens.expected() > self.input_tokens.expected()
        ):
            raise ValueError("cached_input_tokens: the mean exceeds input_tokens' mean")
        if self.shared_prefix_tokens > self.cached_fraction() * self.input_tokens.expected() + 1e-9:
            raise ValueError("shared_prefix_tokens: more than the mean cached input tokens")
        return self

    def cached_fraction(self) -> float:
        if self.cached_input_tokens is not None:
            mean_in = self.input_tokens.expected()
            return min(0.999, self.cached_input_tokens.expected() / mean_in) if mean_in else 0.0
        return self.cached_input_fraction or 0.0


class Demand(Strict):
    routes: list[RouteDemand] = Field(min_length=1, description="Peak demand per (model, surface).")
    profiles: dict[str, str] = Field(
        default_factory=dict,
        description="Engine profile per self-hosted backend, e.g. {vllm-llama-8b: llama-3.1-8b-h200}.",
    )
    gpu_hourly_usd: float = Field(2.5, gt=0, description="USD per GPU-hour (an assumption: set yours).")
    gpu_hourly_usd_by_profile: dict[str, float] = Field(
        default_factory=dict, description="USD per GPU-hour for a profile's GPU, over gpu_hourly_usd."
    )
    headroom: float = Field(
        0.1, ge=0, lt=1, description="Share of a replica's SLO-meeting throughput kept free for bursts."
    )
    average_over_peak: float = Field(
        1.0, gt=0, le=1, description="Daily mean QPS / peak QPS, for $/day (GPUs stay sized for peak)."
    )
    cache_what_if_points: float = Field(
        10.0, ge=-100, le=100, description="What-if: prefix-cache hit rate change, in percentage points."
    )

    @field_validator("profiles", "gpu_hourly_usd_by_profile")
    @classmethod
    def _known_profiles(cls, v: JSONObject, info: ValidationInfo) -> JSONObject:
        names = v.values() if info.field_name == "profiles" else v.keys()
        for name in names:
            if name not in PROFILES:
                raise ValueError(f"unknown profile '{name}'; known: {', '.join(sorted(PROFILES))}")
        return v


class DemandError(ConfigError):
    """A demand file that cannot be used; the message names the file and the field."""


def load_demand(path: str | os.PathLike[str]) -> Demand:
    return parse_demand(read_yaml(path, DemandError), source=str(Path(path)))


def parse_demand(raw: JSON, source: str = "<demand>") -> Demand:
    return validate(Demand, raw, source, "demand", DemandError)
