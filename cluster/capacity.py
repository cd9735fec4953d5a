"""The capacity planner: peak demand per (model, surface) against provider RPM/TPM caps and against
self-hosted replicas (KV memory, compute, HBM bandwidth), the binding constraint, replicas, GPUs
and money. Pure: a config, a demand file and the engine profiles in, a :class:`Plan` out.

The replica model is the simulated engine's physics (:mod:`cluster.profiles`: roofline step times,
paged KV, chunked prefill under a token budget) in mean field, with the fluctuations that matter.
A replica running ``B`` sequences of a workload (mean prompt ``I`` of which ``C`` cached, mean
output ``O``) keeps each one for ``k`` prefill chunks and ``O - 1`` decode steps:

* steps: every step decodes ``D`` sequences; prefill arrives in lumps (a Poisson number of prompt
  chunks per step, the overflow of the token budget carried as extra full steps), so some steps
  carry a prompt and are compute-bound and the rest only decode and are bandwidth-bound (weights
  + KV read). Their mix gives the mean step ``τ``; the ITL a token sees is longer than ``τ`` when
  prefill is a large share of the time (long steps let more prompts in, which then decode);
* throughput ``X = B / (k·τ + (O-1)·ITL)`` requests/s (Little's law), solved together with
  ``D = X·(O-1)·ITL`` and ``X·τ`` prompts admitted per step;
* p95 TTFT = half the step in flight + the M/G/1 wait behind queued prefill + a p95 prompt's chunks;
* ``B`` is bounded by ``max_num_seqs``, by the KV cache (``capacity / KV per sequence``, the KV per
  sequence length-biased: long answers stay resident longer) and by the step token budget;
* the operating batch ``B*`` is the largest that meets the surface's TTFT (p95) and ITL (mean)
  objectives, so a 100 ms Tab runs smaller batches than a 4 s Agent. What caps ``B*`` is the
  binding constraint (for an objective: compute or bandwidth, whichever bounds the steps);
  replicas = peak QPS / (X(B*) · (1 - headroom)).

``loadtest/planner_validation.py`` checks these predictions against the engine model.

Simplifications: one workload per replica (surfaces sharing a backend are sized apart and their
fractional replicas summed); prompt and output lengths independent and log-normal when only
percentiles are given; cached tokens save prefill compute, and only ``shared_prefix_tokens`` save
KV memory (a system prompt is held once; a conversation's own history is not shared); one
tokenizer counts every token, the providers' included.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.config import (
    BackendConfig,
    ClusterConfig,
    ConfigError,
    ModelConfig,
    ProviderConfig,
    format_validation_error,
)
from cluster.profiles import PROFILES, BatchShape, ModelSpec, Profile, RooflineStepTime, get_profile

# --------------------------------------------------------------------------------------------
# The demand file
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenDist(_Strict):
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
    def _number_is_constant(cls, data: Any) -> Any:
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


class RouteDemand(_Strict):
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


class Demand(_Strict):
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
    def _known_profiles(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        names = v.values() if info.field_name == "profiles" else v.keys()
        for name in names:
            if name not in PROFILES:
                raise ValueError(f"unknown profile '{name}'; known: {', '.join(sorted(PROFILES))}")
        return v


class DemandError(ConfigError):
    """A demand file that cannot be used; the message names the file and the field."""


def load_demand(path: str | os.PathLike[str]) -> Demand:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError as exc:
        raise DemandError(f"{p}: no such file") from exc
    except yaml.YAMLError as exc:
        raise DemandError(f"{p}: not valid YAML: {exc}") from exc
    return parse_demand(raw, source=str(p))


def parse_demand(raw: Any, source: str = "<demand>") -> Demand:
    if not isinstance(raw, dict):
        raise DemandError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    try:
        return Demand.model_validate(raw)
    except ValidationError as exc:
        raise DemandError(f"{source}: invalid demand:\n{format_validation_error(exc)}") from exc


# --------------------------------------------------------------------------------------------
# The replica model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """The moments of one route's requests the replica model needs (tokens)."""

    input_mean: float
    output_mean: float
    input_m2: float = 0.0  # E[I²]; 0: input_mean² (constant)
    output_m2: float = 0.0  # E[O²]; 0: output_mean² (constant)
    input_p95: float = 0.0  # 0: input_mean
    cached_fraction: float = 0.0
    shared_prefix: float = 0.0

    @classmethod
    def from_demand(cls, d: RouteDemand, cached_fraction: float | None = None) -> Workload:
        return cls(
            input_mean=d.input_tokens.expected(),
            output_mean=max(1.0, d.output_tokens.expected()),
            input_m2=d.input_tokens.second_moment(),
            output_m2=max(1.0, d.output_tokens.second_moment()),
            input_p95=d.input_tokens.quantile(0.95),
            cached_fraction=d.cached_fraction() if cached_fraction is None else cached_fraction,
            shared_prefix=d.shared_prefix_tokens,
        )

    @property
    def cached_mean(self) -> float:
        return self.cached_fraction * self.input_mean

    def uncached(self, prompt: float) -> float:
        """Tokens of a prompt the engine computes (at least the last one). The mean cached tokens
        come off every prompt alike: a long prompt is not assumed to hit more."""
        return max(1.0, prompt - self.cached_mean)


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    batch: int  # sequences running at once on one replica
    binding: str  # what stops a bigger batch
    itl_s: float  # mean inter-token latency
    ttft_p95_s: float
    step_regime: str  # "compute" or "bandwidth": what the mean step is bound by
    requests_per_s: float  # per replica
    output_tokens_per_s: float
    latency_s: float  # mean request latency (Little's law: concurrency = QPS x latency)
    feasible: bool = True
    reason: str = ""
    limit: str = ""  # the objective that stops a bigger batch: "TTFT", "ITL", or "" (capacity)


@dataclass(frozen=True, slots=True)
class _State:
    decodes: float  # sequences decoding in a step
    prefill_per_step: float  # prompt tokens computed per step
    mean_step: float  # seconds
    in_flight: float  # mean length of the step in flight at a random instant
    itl: float  # mean inter-token latency a token sees
    latency: float  # seconds a request stays resident
    throughput: float  # requests per second


class ReplicaModel:
    """One replica of ``profile`` serving ``workload`` in steady state, in mean field."""

    def __init__(self, profile: Profile, workload: Workload) -> None:
        self.profile = profile
        self.w = workload
        self.stm = profile.step_time_model()
        e = profile.engine
        self.budget = e.max_num_batched_tokens
        self.block_size = e.block_size
        self.max_num_seqs = e.max_num_seqs
        w = workload
        self.pu = w.uncached(w.input_mean)  # prefill tokens per request
        self.cached = w.input_mean - self.pu
        i2 = w.input_m2 or w.input_mean**2
        self.pu_m2 = max(self.pu**2, i2 - 2 * self.cached * w.input_mean + self.cached**2)  # E[Pu²]
        self.pu_p95 = w.uncached(w.input_p95 or w.input_mean)
        self.k = max(1, math.ceil(self.pu / self.budget))  # prefill chunks (steps) per request
        self.o = w.output_mean
        self.resident_steps = self.o - 1 + self.k
        # Context of a decoding sequence, averaged over its decode steps and length-biased (a long
        # answer is resident longer): I + E[O(O-1)/2] / E[O-1].
        m2 = w.output_m2 or self.o**2
        self.ctx_decode = w.input_mean + ((m2 - self.o) / (2 * (self.o - 1)) if self.o > 1 else 0.0)
        self.pairs_per_prefill = self.pu * self.cached + (self.pu_m2 + self.pu) / 2  # causal attention
        self._states: dict[float, _State] = {}

    # --- KV --------------------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int:
        return self.profile.num_kv_blocks() * self.block_size

    def kv_tokens_per_seq(self) -> float:
        """Private KV tokens a resident sequence holds on average (+ half a block of rounding)."""
        avg = (self.k * self.w.input_mean + (self.o - 1) * self.ctx_decode) / self.resident_steps
        return max(1.0, avg - self.w.shared_prefix) + self.block_size / 2

    def max_batch(self) -> tuple[int, str]:
        """The most sequences one replica runs at once, and what bounds it."""
        kv = (self.kv_capacity_tokens() - self.w.shared_prefix) / self.kv_tokens_per_seq()
        per_step = ((self.o - 1) + self.pu) / self.resident_steps  # tokens per resident seq per step
        bounds = {
            "KV memory": math.floor(kv),
            "max_num_seqs": self.max_num_seqs,
            "token budget": math.floor(self.budget / per_step),
        }
        name = min(bounds, key=lambda n: bounds[n])
        return max(0, bounds[name]), name

    # --- steps -----------------------------------------------------------------------------
    def _shape(self, d: float, prefill: float) -> BatchShape:
        """A step that decodes ``d`` sequences and computes ``prefill`` prompt tokens."""
        dec_read = d * self.ctx_decode
        prompts = prefill / self.pu  # prompts' worth of prefill in this step
        return BatchShape(  # type: ignore[arg-type]  # mean field: fractional tokens
            prefill_tokens=prefill,
            decode_tokens=d,
            kv_read_tokens=dec_read + prompts * self.w.input_mean,
            attn_pairs=dec_read + prompts * self.pairs_per_prefill,
        )

    def _steps(self, d: float, per_step: float) -> list[tuple[float, BatchShape]]:
        """The steps that decode ``d`` sequences and prefill ``per_step`` tokens on average, as (share
        of steps, shape). Prefill comes in lumps: a Poisson number of chunks per step (a prompt, or a
        budget's worth of a long one), and a step with a prompt is far longer than one without. Work
        is conserved: chunks that overflow a step's budget make extra full steps, so near the budget
        nearly every step is full (a backlog)."""
        room = max(1.0, self.budget - d)
        chunk = min(self.pu, room)
        if self.o <= 1:  # nothing decodes: every step is a prefill step
            return [(1.0, self._shape(d, max(chunk, min(per_step, room))))]
        if per_step >= room * (1 - 1e-6):  # the budget is saturated: a backlog fills every step
            return [(1.0, self._shape(d, room))]
        # Chunks arrive per "epoch" (a step plus the overflow steps it causes); find the epoch rate
        # that gives ``per_step`` tokens per actual step.
        lo = hi = per_step / chunk
        while self._epoch(hi, chunk, room)[0] < per_step:
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._epoch(mid, chunk, room)[0] < per_step else (lo, mid)
        return [(p, self._shape(d, tokens)) for p, tokens in self._epoch(hi, chunk, room)[1]]

    @staticmethod
    def _epoch(rate: float, chunk: float, room: float) -> tuple[float, list[tuple[float, float]]]:
        """Poisson(rate) chunks per epoch: (mean prefill tokens per step, [(share of steps, tokens)])."""
        steps: list[tuple[float, float]] = []
        n, prob, total, extra, work = 0, math.exp(-rate), 0.0, 0.0, 0.0
        while total < 1 - 1e-9 and n < 100_000:
            tokens = n * chunk
            steps.append((prob, min(tokens, room)))
            extra += prob * max(0.0, tokens - room) / room  # overflow steps, full
            work += prob * tokens
            total += prob
            n += 1
            prob *= rate / n
        steps.append((extra, room))
        norm = total + extra
        return work / norm, [(p / norm, t) for p, t in steps if p > 0]

    def state(self, b: float) -> _State:
        """The steady state at ``b`` running sequences, solved for consistency: with a mean step
        ``τ`` and a mean ITL ``I``, a request stays ``k·τ + (O-1)·I`` (so throughput X = b / that),
        ``X·(O-1)·I`` sequences decode in a step and ``X·τ`` prompts are admitted per step; those
        give the steps, hence ``τ`` and ``I``.

        ``I`` is not ``τ``: prefill makes steps long, a long step lets more prompts arrive, and they
        make the next steps long too (an AR(1) chain whose coefficient is the share of time spent on
        prefill, ``rho``); those prompts then decode, so the steps with the most decoders are the
        long ones: I = E[D·t] / E[D] = τ + Var(t)·rho / ((1 - rho)·τ·(O - 1))."""
        hit = self._states.get(b)
        if hit is not None:
            return hit
        tau = itl = 0.0
        d, per_step = b * (self.o - 1) / self.resident_steps, b / self.resident_steps * self.pu
        for _ in range(30):
            times = [(p, self.stm.step_time(shape)) for p, shape in self._steps(d, per_step)]
            new_tau = sum(p * t for p, t in times)
            second = sum(p * t * t for p, t in times)
            room = max(1.0, self.budget - d)
            slope = (self.stm.step_time(self._shape(d, room)) - self.stm.step_time(self._shape(d, 0))) / room
            rho = min(0.95, slope * per_step / new_tau)
            var = (second - new_tau**2) * self.pu_m2 / self.pu**2 / (1 - rho * rho)  # prompt sizes vary
            new_itl = new_tau + (var * rho / ((1 - rho) * new_tau * (self.o - 1)) if self.o > 1 else 0.0)
            done = abs(new_itl - itl) < 1e-6 * new_itl and abs(new_tau - tau) < 1e-6 * new_tau
            tau, itl = (new_tau, new_itl) if not tau else ((tau + new_tau) / 2, (itl + new_itl) / 2)
            latency = self.k * tau + (self.o - 1) * itl
            x = b / latency
            d, per_step = x * (self.o - 1) * itl, x * tau * self.pu
            if done:
                break
        out = self._states[b] = _State(d, per_step, tau, second / new_tau, itl, latency, x)
        return out

    def itl(self, b: float) -> float:
        return self.state(b).itl

    def latency(self, b: float) -> float:
        """Seconds a request stays resident: its prefill chunks, then one ITL per further token."""
        return self.state(b).latency

    def throughput(self, b: float) -> float:
        """Requests per second at ``b`` running sequences (Little's law)."""
        return self.state(b).throughput

    def prefill_time(self, d: float, prompt: float) -> float:
        """Steps to prefill ``prompt`` uncached tokens riding along with ``d`` decodes."""
        room = max(1.0, self.budget - d)
        past = self.cached
        t = 0.0
        while prompt > 0:
            n = min(prompt, room)
            shape = BatchShape(  # type: ignore[arg-type]
                prefill_tokens=n,
                decode_tokens=d,
                kv_read_tokens=d * self.ctx_decode + past + n,
                attn_pairs=d * self.ctx_decode + n * past + n * (n + 1) / 2,
            )
            t += self.stm.step_time(shape)
            past += n
            prompt -= n
        return t

    def ttft_p95(self, b: float) -> float:
        """p95 TTFT at ``b``: half the step in flight at arrival, the wait behind the prefill queued
        ahead, then the request's own chunks (for a p95 prompt). The wait is M/G/1: prompts arrive
        at random, and while there is a backlog every step is full, so the queue drains at ``room``
        tokens per full step; its tail is taken as exponential: P(W > t) = rho·exp(-t·rho/E[W])."""
        st = self.state(b)
        room = max(1.0, self.budget - st.decodes)
        per_token = self.stm.step_time(self._shape(st.decodes, room)) / room  # s per token, backlogged
        rho = st.throughput * per_token * self.pu
        if rho >= 1:
            return math.inf
        wait = st.throughput * per_token**2 * self.pu_m2 / (2 * (1 - rho))  # Pollaczek-Khinchine
        wait95 = wait / rho * math.log(20 * rho) if 20 * rho > 1 else 0.0
        return st.in_flight / 2 + wait95 + self.prefill_time(st.decodes, self.pu_p95)

    def _split(self, x: BatchShape) -> tuple[float, float]:
        """(compute seconds, memory seconds) of a step on a roofline profile."""
        s = self.stm
        assert isinstance(s, RooflineStepTime)
        flops = s.flops_per_token * x.num_tokens + s.attn_flops_per_pair * x.attn_pairs
        memory = s.weight_bytes + s.kv_bytes_per_token * x.kv_read_tokens
        return flops / s.flops_per_s, memory / s.bytes_per_s

    def regime(self, b: float) -> str:
        """What the mean step at ``b`` is bound by: "compute" or "bandwidth" (fitted models: compute)."""
        if not isinstance(self.stm, RooflineStepTime):
            return "compute"
        compute = memory = 0.0  # time in compute-bound steps against time in bandwidth-bound ones
        st = self.state(b)
        for p, x in self._steps(st.decodes, st.prefill_per_step):
            c, m = self._split(x)
            if c > m:
                compute += p * c
            else:
                memory += p * m
        return "compute" if compute > memory else "bandwidth"

    def prefill_regime(self, b: float) -> str:
        """What a step carrying a p95 prompt's chunk is bound by."""
        if not isinstance(self.stm, RooflineStepTime):
            return "compute"
        d = self.state(b).decodes
        c, m = self._split(self._shape(d, min(self.pu_p95, max(1.0, self.budget - d))))
        return "compute" if c > m else "bandwidth"

    # --- the operating point ---------------------------------------------------------------
    def operating_point(self, ttft_slo_s: float | None, itl_slo_s: float | None) -> OperatingPoint:
        """The largest batch that meets both objectives (within the replica's bounds)."""
        b_max, bound = self.max_batch()
        if b_max < 1:
            need = self.kv_tokens_per_seq()
            return self._point(
                1,
                "KV memory",
                False,
                f"one sequence needs {need:.0f} KV tokens, a replica holds {self.kv_capacity_tokens()}",
            )

        def missed(b: int) -> str:
            if itl_slo_s is not None and self.itl(b) > itl_slo_s:
                return "itl"
            if ttft_slo_s is not None and self.ttft_p95(b) > ttft_slo_s:
                return "ttft"
            return ""

        first = missed(1)
        if first:
            what = "ITL" if first == "itl" else "p95 TTFT"
            got = self.itl(1) if first == "itl" else self.ttft_p95(1)
            slo = itl_slo_s if first == "itl" else ttft_slo_s
            return self._point(
                1,
                self._slo_binding(first, 1),
                False,
                f"{what} {got * 1e3:.0f} ms at batch 1 misses the {slo * 1e3:.0f} ms objective",  # type: ignore[operator]
                limit=first.upper(),
            )
        if not missed(b_max):
            return self._point(b_max, bound)
        lo, hi = 1, b_max  # lo meets the objectives, hi misses one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not missed(mid) else (lo, mid)
        which = missed(hi)
        return self._point(lo, self._slo_binding(which, hi), limit=which.upper())

    def _slo_binding(self, which: str, b: int) -> str:
        return self.prefill_regime(b) if which == "ttft" else self.regime(b)

    def _point(
        self, b: int, binding: str, feasible: bool = True, reason: str = "", limit: str = ""
    ) -> OperatingPoint:
        itl = self.itl(b)
        rps = self.throughput(b)
        return OperatingPoint(
            batch=b,
            binding=binding,
            itl_s=itl,
            ttft_p95_s=self.ttft_p95(b),
            step_regime=self.regime(b),
            requests_per_s=rps if feasible else 0.0,
            output_tokens_per_s=rps * self.o if feasible else 0.0,
            latency_s=self.latency(b),
            feasible=feasible,
            reason=reason,
            limit=limit,
        )


# --------------------------------------------------------------------------------------------
# Config → engine profiles
# --------------------------------------------------------------------------------------------

DEFAULT_SIM_PROFILE = "cpu-tiny"  # as cluster.sim_backend: a sim backend that names no profile


def backend_profile(cfg: ClusterConfig, backend: BackendConfig, demand: Demand) -> Profile:
    """The engine profile a self-hosted backend runs: the demand file's ``profiles`` entry, else the
    sim backend's ``sim_profile``, else (vLLM) the registered profile of the same model and tensor
    parallelism, on a GPU when the replicas ask for GPUs. The model's KV geometry from the config
    and the backend's engine arguments are laid over it, as the simulated backend does."""
    model = cfg.model(backend.model)
    assert model is not None  # the config checked its references
    name = demand.profiles.get(backend.name)
    if name is None and backend.kind == "sim":
        name = backend.sim_profile or DEFAULT_SIM_PROFILE
    if name is None:
        name = _matching_profile(backend, model)
    profile = _with_engine(_with_model(get_profile(name), model), backend, model)
    try:
        blocks = profile.num_kv_blocks()
    except ValueError as exc:
        raise DemandError(f"profiles.{backend.name}: {exc}") from None
    if blocks * profile.engine.block_size < profile.max_model_len():
        raise DemandError(
            f"profiles.{backend.name}: profile '{name}' holds {blocks * profile.engine.block_size} KV "
            f"tokens, less than max_model_len {profile.max_model_len()}"
        )
    return profile


def _matching_profile(backend: BackendConfig, model: ModelConfig) -> str:
    tp = backend.engine.tensor_parallel_size
    on_gpu = backend.resources.num_gpus > 0
    for p in PROFILES.values():  # registry order: the H100 variant before the H200 one
        same_model = p.model.name in (model.name, model.path)
        if same_model and p.engine.tensor_parallel_size == tp and (p.gpu is not None) == on_gpu:
            return p.name
    raise DemandError(
        f"profiles.{backend.name}: no engine profile matches backend '{backend.name}' ({model.name}, "
        f"TP {tp}, {'GPU' if on_gpu else 'CPU'}); name one (known: {', '.join(sorted(PROFILES))})"
    )


def _with_model(profile: Profile, model: ModelConfig) -> Profile:
    """The config's KV geometry (e.g. an fp8 KV cache) and parameter count over the profile's."""
    changes: dict[str, Any] = {}
    if model.kv is not None:
        changes.update(
            layers=model.kv.layers,
            kv_heads=model.kv.kv_heads,
            head_dim=model.kv.head_dim,
            kv_dtype_bytes=model.kv.dtype_bytes,
        )
    if model.params_b is not None and abs(model.params_b * 1e9 / profile.model.params - 1) > 0.01:
        changes["params"] = int(model.params_b * 1e9)  # another model: the profile's count is no guide
    if not changes:
        return profile
    spec = ModelSpec.model_validate({**profile.model.model_dump(), **changes})
    return profile.model_copy(update={"model": spec})


def _with_engine(profile: Profile, backend: BackendConfig, model: ModelConfig) -> Profile:
    # The same overlay as cluster.sim_backend.SimBackend.from_config, so that a plan and a sim
    # replica of one backend agree.
    e = backend.engine
    changes: dict[str, Any] = {
        "block_size": e.block_size,
        "max_num_seqs": e.max_num_seqs,
        "max_model_len": e.max_model_len or model.context_window,
        "kv_cache_bytes": e.kv_cache_memory_bytes,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "max_num_batched_tokens": e.max_num_batched_tokens,
    }
    if e.tensor_parallel_size != 1:
        changes["tensor_parallel_size"] = e.tensor_parallel_size
    return profile.with_engine(**{k: v for k, v in changes.items() if v is not None})


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass
class Rates:
    """Peak demand per minute."""

    requests_per_min: float
    input_tokens_per_min: float  # cached included
    cached_input_tokens_per_min: float
    output_tokens_per_min: float


@dataclass
class ProviderLoad:
    """One route's whole demand against one provider's caps and prices."""

    backend: str
    rpm_limit: int | None
    tpm_limit: int | None
    tpm_needed: float  # input + max_tokens (or output) per minute, as providers count
    rpm_utilization: float | None  # fraction of the cap; None: no cap
    tpm_utilization: float | None
    binding: str  # "RPM", "TPM" or "none"
    fits: bool
    usd_per_mtok: float  # blended over the route's input, cached input and output
    usd_per_day: float


@dataclass
class SelfHosted:
    backend: str
    profile: str
    gpus_per_replica: int
    kv_bytes_per_token: int  # whole replica (all TP shards)
    kv_tokens_per_request: float  # resident on average, private (shared prefix apart)
    kv_bytes_per_request: float
    kv_capacity_tokens: int  # per replica
    kv_capacity_bytes: int
    max_batch: int  # sequences a replica can hold at once
    max_batch_bound: str  # "KV memory", "max_num_seqs" or "token budget"
    batch: int  # the batch that meets the objectives
    binding: str  # what stops a bigger batch: one of the above, or "compute" / "bandwidth" (SLO)
    slo_limit: str  # the objective behind a compute/bandwidth binding: "TTFT" or "ITL" ("": none)
    step_regime: str  # what the mean step is bound by at that batch
    itl_ms: float
    ttft_p95_ms: float
    requests_per_s_per_replica: float
    output_tokens_per_s_per_replica: float
    latency_s: float
    peak_concurrency: float  # Little's law: peak QPS x latency
    kv_bytes_at_peak: float
    replicas: float  # fractional: this route's share, headroom included
    gpus: float
    usd_per_day: float
    usd_per_mtok: float
    feasible: bool
    reason: str


@dataclass
class WhatIf:
    cached_fraction: float  # the hit rate tried
    replicas: float | None
    gpus_saved: float | None
    self_hosted_usd_per_day_saved: float | None
    provider: str | None
    provider_usd_per_day_saved: float | None


@dataclass
class RoutePlan:
    model: str
    surface: str
    peak_qps: float
    primary: str  # the backend planned on
    primary_kind: str  # "self-hosted" or "provider"
    ttft_slo_ms: float | None
    itl_slo_ms: float | None
    cached_fraction: float
    demand: Rates
    binding: str
    self_hosted: SelfHosted | None  # the primary, or the first self-hosted candidate as an alternative
    providers: list[ProviderLoad]
    what_if: WhatIf | None
    warnings: list[str] = field(default_factory=list)


@dataclass
class BackendPlan:
    backend: str
    profile: str
    routes: list[str]
    unplanned_routes: list[str]  # routes whose objectives one replica cannot meet (not counted)
    replicas_exact: float
    replicas: int
    gpus: int
    usd_per_day: float
    binding: str  # of the route that needs the most replicas
    what_if_replicas: int | None
    what_if_gpus_saved: int | None
    what_if_usd_per_day_saved: float | None


@dataclass
class ProviderPlan:
    backend: str
    rpm_limit: int | None
    tpm_limit: int | None
    planned_routes: list[str]  # routes it is the first choice of
    planned_rpm_utilization: float | None
    planned_tpm_utilization: float | None
    failover_rpm_utilization: float | None  # every route listing it, all at once
    failover_tpm_utilization: float | None
    planned_usd_per_day: float


@dataclass
class Plan:
    routes: list[RoutePlan]
    backends: list[BackendPlan]
    providers: list[ProviderPlan]
    totals: dict[str, float]
    assumptions: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return _clean(asdict(self))


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def route_name(model: str, surface: str) -> str:
    return f"{surface}/{model}"


def plan(cfg: ClusterConfig, demand: Demand) -> Plan:
    """The plan for ``demand`` on ``cfg``. Raises DemandError naming the field on a bad reference."""
    _check_references(cfg, demand)
    profiles: dict[str, Profile] = {}
    routes = [_plan_route(cfg, demand, i, d, profiles) for i, d in enumerate(demand.routes)]
    backends = _backend_totals(routes, demand, profiles)
    providers = _provider_totals(cfg, routes)
    totals = {
        "gpus": sum(b.gpus for b in backends),
        "self_hosted_usd_per_day": sum(b.usd_per_day for b in backends),
        "provider_usd_per_day": sum(p.planned_usd_per_day for p in providers),
        "what_if_gpus_saved": sum(b.what_if_gpus_saved or 0 for b in backends),
        "what_if_usd_per_day_saved": sum(b.what_if_usd_per_day_saved or 0 for b in backends)
        + sum(
            r.what_if.provider_usd_per_day_saved or 0
            for r in routes
            if r.what_if and r.primary_kind == "provider"
        ),
    }
    assumptions = {
        "gpu_hourly_usd": demand.gpu_hourly_usd,
        "gpu_hourly_usd_by_profile": dict(demand.gpu_hourly_usd_by_profile),
        "headroom": demand.headroom,
        "average_over_peak": demand.average_over_peak,
        "cache_what_if_points": demand.cache_what_if_points,
        "ttft": "p95, of a p95 prompt",
        "itl": "mean over tokens",
    }
    return Plan(routes, backends, providers, totals, assumptions)


def _check_references(cfg: ClusterConfig, demand: Demand) -> None:
    seen: set[tuple[str, str]] = set()
    for i, d in enumerate(demand.routes):
        if cfg.model(d.model) is None:
            raise DemandError(f"routes[{i}].model: unknown model '{d.model}' (not in the config)")
        if cfg.surface(d.surface) is None:
            raise DemandError(f"routes[{i}].surface: unknown surface '{d.surface}' (not in the config)")
        if (d.model, d.surface) in seen:
            raise DemandError(f"routes[{i}]: a second entry for ({d.model}, {d.surface})")
        seen.add((d.model, d.surface))
        if d.backend is not None:
            names = {b.name: b for b in cfg.backends}
            if d.backend not in names or names[d.backend].model != d.model:
                raise DemandError(f"routes[{i}].backend: no backend '{d.backend}' serves '{d.model}'")
    names = {b.name: b for b in cfg.backends}
    for backend in demand.profiles:
        if backend not in names or names[backend].kind == "provider":
            raise DemandError(f"profiles.{backend}: no self-hosted backend '{backend}' in the config")


def _plan_route(
    cfg: ClusterConfig, demand: Demand, i: int, d: RouteDemand, profiles: dict[str, Profile]
) -> RoutePlan:
    surface = cfg.surface(d.surface)
    assert surface is not None
    candidates = cfg.candidates(d.model, d.surface)
    primary = d.backend or candidates[0]
    kinds = {b.name: b.kind for b in cfg.backends}
    ttft = d.ttft_slo_ms or surface.ttft_slo_ms
    frac = d.cached_fraction()
    i_mean, o_mean = d.input_tokens.expected(), d.output_tokens.expected()
    per_min = d.peak_qps * 60
    rates = Rates(per_min, per_min * i_mean, per_min * i_mean * frac, per_min * o_mean)
    warnings: list[str] = []

    hosted_name = (
        primary
        if kinds[primary] != "provider"
        else next((c for c in candidates if kinds[c] != "provider"), None)
    )
    hosted = None
    if hosted_name is not None:
        if hosted_name not in profiles:
            profiles[hosted_name] = backend_profile(cfg, cfg.backend(hosted_name), demand)
        hosted = _self_hosted(profiles[hosted_name], hosted_name, d, demand, ttft, frac)
        p95_len = d.input_tokens.quantile(0.95) + d.output_tokens.quantile(0.95)
        if p95_len > profiles[hosted_name].max_model_len():
            warnings.append(
                f"p95 prompt + p95 output ({p95_len:.0f}) exceed {hosted_name}'s max_model_len "
                f"{profiles[hosted_name].max_model_len()}: those requests overflow or get a 400"
            )
        if not hosted.feasible:
            warnings.append(f"{hosted_name}: {hosted.reason}")
        if hosted.gpus_per_replica == 0:
            warnings.append(f"{hosted_name}: CPU replicas, no GPU cost counted")

    provider_names = [c for c in dict.fromkeys([primary, *candidates]) if kinds[c] == "provider"]
    loads = [_provider_load(cfg.backend(n).provider, n, d, demand, frac) for n in provider_names]  # type: ignore[arg-type]
    for load in loads:
        if load.backend == primary and not load.fits:
            warnings.append(f"{primary}: demand exceeds its {load.binding} cap")

    if kinds[primary] == "provider":
        binding = next(p.binding for p in loads if p.backend == primary)
    else:
        assert hosted is not None
        binding = hosted.binding

    what_if = _what_if(cfg, demand, d, primary, hosted, loads, ttft, frac, profiles.get(hosted_name or ""))
    return RoutePlan(
        model=d.model,
        surface=d.surface,
        peak_qps=d.peak_qps,
        primary=primary,
        primary_kind="provider" if kinds[primary] == "provider" else "self-hosted",
        ttft_slo_ms=ttft,
        itl_slo_ms=d.itl_slo_ms,
        cached_fraction=frac,
        demand=rates,
        binding=binding,
        self_hosted=hosted,
        providers=loads,
        what_if=what_if,
        warnings=warnings,
    )


def _gpu_price(demand: Demand, profile: Profile) -> float:
    return demand.gpu_hourly_usd_by_profile.get(profile.name, demand.gpu_hourly_usd)


def _self_hosted(
    profile: Profile, backend: str, d: RouteDemand, demand: Demand, ttft_ms: float, frac: float
) -> SelfHosted:
    model = ReplicaModel(profile, Workload.from_demand(d, cached_fraction=frac))
    op = model.operating_point(ttft_ms / 1e3, d.itl_slo_ms / 1e3 if d.itl_slo_ms else None)
    b_max, bound = model.max_batch()
    tp = profile.engine.tensor_parallel_size
    gpus_per_replica = tp if profile.gpu is not None else 0
    kv_token = profile.model.kv_bytes_per_token(tp) * tp  # replicated KV heads count on every GPU
    kv_req = model.kv_tokens_per_seq()
    capacity = model.kv_capacity_tokens()
    replicas = d.peak_qps / (op.requests_per_s * (1 - demand.headroom)) if op.feasible else math.inf
    gpus = replicas * gpus_per_replica
    usd_day = gpus * _gpu_price(demand, profile) * 24
    tokens_day = demand.average_over_peak * d.peak_qps * 86400 * (model.w.input_mean + model.w.output_mean)
    concurrency = d.peak_qps * op.latency_s
    return SelfHosted(
        backend=backend,
        profile=profile.name,
        gpus_per_replica=gpus_per_replica,
        kv_bytes_per_token=kv_token,
        kv_tokens_per_request=kv_req,
        kv_bytes_per_request=kv_req * kv_token,
        kv_capacity_tokens=capacity,
        kv_capacity_bytes=capacity * kv_token,
        max_batch=b_max,
        max_batch_bound=bound,
        batch=op.batch,
        binding=op.binding,
        slo_limit=op.limit,
        step_regime=op.step_regime,
        itl_ms=op.itl_s * 1e3,
        ttft_p95_ms=op.ttft_p95_s * 1e3,
        requests_per_s_per_replica=op.requests_per_s,
        output_tokens_per_s_per_replica=op.output_tokens_per_s,
        latency_s=op.latency_s,
        peak_concurrency=concurrency,
        kv_bytes_at_peak=concurrency * kv_req * kv_token,
        replicas=replicas,
        gpus=gpus,
        usd_per_day=usd_day,
        usd_per_mtok=usd_day / tokens_day * 1e6,
        feasible=op.feasible,
        reason=op.reason,
    )


def _provider_load(p: ProviderConfig, name: str, d: RouteDemand, demand: Demand, frac: float) -> ProviderLoad:
    i_mean, o_mean = d.input_tokens.expected(), d.output_tokens.expected()
    rpm = d.peak_qps * 60
    tpm = rpm * (i_mean + (d.max_tokens or o_mean))
    rpm_u = rpm / p.rpm if p.rpm else None
    tpm_u = tpm / p.tpm if p.tpm else None
    binding = "TPM" if (tpm_u or 0) >= (rpm_u or 0) else "RPM"
    if rpm_u is None and tpm_u is None:
        binding = "none"
    cost = _request_usd(p, i_mean, o_mean, frac)
    return ProviderLoad(
        backend=name,
        rpm_limit=p.rpm,
        tpm_limit=p.tpm,
        tpm_needed=tpm,
        rpm_utilization=rpm_u,
        tpm_utilization=tpm_u,
        binding=binding,
        fits=max(rpm_u or 0, tpm_u or 0) <= 1,
        usd_per_mtok=cost / (i_mean + o_mean) * 1e6,
        usd_per_day=cost * d.peak_qps * 86400 * demand.average_over_peak,
    )


def _request_usd(p: ProviderConfig, i_mean: float, o_mean: float, frac: float) -> float:
    cached = i_mean * frac
    return (
        (i_mean - cached) * p.cost_per_mtok_input
        + cached * p.cost_per_mtok_cached_input
        + o_mean * p.cost_per_mtok_output
    ) / 1e6


def _what_if(
    cfg: ClusterConfig,
    demand: Demand,
    d: RouteDemand,
    primary: str,
    hosted: SelfHosted | None,
    loads: list[ProviderLoad],
    ttft_ms: float,
    frac: float,
    profile: Profile | None,
) -> WhatIf | None:
    if demand.cache_what_if_points == 0:
        return None
    i_mean = d.input_tokens.expected()
    new = min(max(frac + demand.cache_what_if_points / 100, d.shared_prefix_tokens / i_mean), 1 - 1 / i_mean)
    replicas = saved = usd_saved = None
    if hosted is not None and profile is not None:
        after = _self_hosted(profile, hosted.backend, d, demand, ttft_ms, new)
        replicas = after.replicas
        saved = hosted.gpus - after.gpus
        usd_saved = hosted.usd_per_day - after.usd_per_day
    provider = next((p.backend for p in loads if p.backend == primary), loads[0].backend if loads else None)
    p_saved = None
    if provider is not None:
        pc = cfg.backend(provider).provider
        assert pc is not None
        o_mean = d.output_tokens.expected()
        per_day = d.peak_qps * 86400 * demand.average_over_peak
        p_saved = (_request_usd(pc, i_mean, o_mean, frac) - _request_usd(pc, i_mean, o_mean, new)) * per_day
    return WhatIf(new, replicas, saved, usd_saved, provider, p_saved)


def _backend_totals(
    routes: list[RoutePlan], demand: Demand, profiles: dict[str, Profile]
) -> list[BackendPlan]:
    """Replicas per self-hosted backend: the routes' fractional shares summed, then rounded up."""
    out: list[BackendPlan] = []
    for name in dict.fromkeys(r.primary for r in routes if r.primary_kind == "self-hosted"):
        mine = [r for r in routes if r.primary == name and r.self_hosted is not None]
        ok = [r for r in mine if r.self_hosted and r.self_hosted.feasible]
        profile = profiles[name]
        per_replica = mine[0].self_hosted.gpus_per_replica if mine[0].self_hosted else 0
        per_gpu_day = _gpu_price(demand, profile) * 24
        exact = sum(r.self_hosted.replicas for r in ok if r.self_hosted)
        after = sum(
            r.what_if.replicas if r.what_if and r.what_if.replicas is not None else r.self_hosted.replicas
            for r in ok
            if r.self_hosted
        )
        replicas = math.ceil(exact - 1e-9)
        saved = (replicas - math.ceil(after - 1e-9)) * per_replica if demand.cache_what_if_points else None
        worst = max(mine, key=lambda r: r.self_hosted.replicas if r.self_hosted else 0)
        out.append(
            BackendPlan(
                backend=name,
                profile=profile.name,
                routes=[route_name(r.model, r.surface) for r in mine],
                unplanned_routes=[route_name(r.model, r.surface) for r in mine if r not in ok],
                replicas_exact=exact,
                replicas=replicas,
                gpus=replicas * per_replica,
                usd_per_day=replicas * per_replica * per_gpu_day,
                binding=worst.binding,
                what_if_replicas=math.ceil(after - 1e-9) if saved is not None else None,
                what_if_gpus_saved=saved,
                what_if_usd_per_day_saved=saved * per_gpu_day if saved is not None else None,
            )
        )
    return out


def _provider_totals(cfg: ClusterConfig, routes: list[RoutePlan]) -> list[ProviderPlan]:
    out: list[ProviderPlan] = []
    names = dict.fromkeys(p.backend for r in routes for p in r.providers)
    for name in names:
        pc = cfg.backend(name).provider
        assert pc is not None
        planned = [(r, p) for r in routes for p in r.providers if p.backend == name and r.primary == name]
        listed = [(r, p) for r in routes for p in r.providers if p.backend == name]

        def util(pairs: list[tuple[RoutePlan, ProviderLoad]], tokens: bool, cap: int | None) -> float | None:
            if cap is None:
                return None
            need = sum(p.tpm_needed if tokens else r.demand.requests_per_min for r, p in pairs)
            return need / cap

        out.append(
            ProviderPlan(
                backend=name,
                rpm_limit=pc.rpm,
                tpm_limit=pc.tpm,
                planned_routes=[route_name(r.model, r.surface) for r, _ in planned],
                planned_rpm_utilization=util(planned, False, pc.rpm),
                planned_tpm_utilization=util(planned, True, pc.tpm),
                failover_rpm_utilization=util(listed, False, pc.rpm),
                failover_tpm_utilization=util(listed, True, pc.tpm),
                planned_usd_per_day=sum(p.usd_per_day for _, p in planned),
            )
        )
    return out
