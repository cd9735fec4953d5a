"""The capacity planner's replica model: what one self-hosted replica sustains for one workload, and
the engine profile a backend runs. Pure: a profile and a workload in, an operating point out.

The model is the simulated engine's physics (:mod:`cluster.engine.profiles`: roofline step times,
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
  binding constraint (for an objective: compute or bandwidth, whichever bounds the steps, or the
  host's CPU for CPU engines whose config describes their host: :mod:`cluster.planner.host_cpu`);
  replicas = peak QPS / (X(B*) · (1 - headroom)).

``loadtest/benchmarks/planner_validation.py`` checks these predictions against the engine model.

Simplifications: one workload per replica (surfaces sharing a backend are sized apart and their
fractional replicas summed); prompt and output lengths independent and log-normal when only
percentiles are given; cached tokens save prefill compute, and only ``shared_prefix_tokens`` save
KV memory (a system prompt is held once; a conversation's own history is not shared); one
tokenizer counts every token, the providers' included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.config import (
    BackendConfig,
    ClusterConfig,
    ModelConfig,
)
from cluster.engine.profiles import (
    PROFILES,
    BatchShape,
    ModelSpec,
    Profile,
    RooflineStepTime,
    StepTimeModel,
    get_profile,
)
from cluster.json_types import JSONObject
from cluster.planner.demand import Demand, DemandError, RouteDemand
from cluster.planner.host_cpu import HostBoundStepTime, HostCpu


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
    step_regime: str  # "compute", "bandwidth" or "host CPU": what the mean step is bound by
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

    def __init__(self, profile: Profile, workload: Workload, host: HostCpu | None = None) -> None:
        self.profile = profile
        self.w = workload
        self.host = host.for_output(workload.output_mean) if host is not None else None
        self.bare = profile.step_time_model()  # the engine with the host to itself
        self.stm: StepTimeModel = (
            HostBoundStepTime(self.bare, self.host) if self.host is not None else self.bare
        )
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
        return BatchShape(  # mean field: fractional tokens
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
            shape = BatchShape(
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
        s = self.bare
        assert isinstance(s, RooflineStepTime)
        flops = s.flops_per_token * x.num_tokens + s.attn_flops_per_pair * x.attn_pairs
        memory = s.weight_bytes + s.kv_bytes_per_token * x.kv_read_tokens
        return flops / s.flops_per_s, memory / s.bytes_per_s

    def regime(self, b: float) -> str:
        """What the mean step at ``b`` is bound by: "host CPU" (the host's cores, see host_cpu.py),
        else "compute" or "bandwidth" (fitted models: compute)."""
        st = self.state(b)
        steps = self._steps(st.decodes, st.prefill_per_step)
        if self.host is not None:
            hosted = sum(
                p * self.stm.step_time(x)
                for p, x in steps
                if self.host.binds(self.bare.step_time(x), x.decode_tokens)
            )
            if hosted > st.mean_step / 2:
                return "host CPU"
        if not isinstance(self.bare, RooflineStepTime):
            return "compute"
        compute = memory = 0.0  # time in compute-bound steps against time in bandwidth-bound ones
        for p, x in steps:
            c, m = self._split(x)
            if c > m:
                compute += p * c
            else:
                memory += p * m
        return "compute" if compute > memory else "bandwidth"

    def prefill_regime(self, b: float) -> str:
        """What a step carrying a p95 prompt's chunk is bound by."""
        d = self.state(b).decodes
        shape = self._shape(d, min(self.pu_p95, max(1.0, self.budget - d)))
        if self.host is not None and self.host.binds(self.bare.step_time(shape), shape.decode_tokens):
            return "host CPU"
        if not isinstance(self.bare, RooflineStepTime):
            return "compute"
        c, m = self._split(shape)
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
            assert slo is not None  # missed() names only an objective that is set
            return self._point(
                1,
                self._slo_binding(first, 1),
                False,
                f"{what} {got * 1e3:.0f} ms at batch 1 misses the {slo * 1e3:.0f} ms objective",
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

DEFAULT_SIM_PROFILE = "cpu-tiny"  # as cluster.engine.sim_backend: a sim backend that names no profile


def backend_profile(cfg: ClusterConfig, backend: BackendConfig, demand: Demand) -> Profile:
    """The engine profile a self-hosted backend runs: the demand file's ``profiles`` entry, else the
    sim backend's ``sim_profile``, else (vLLM) the registered profile of the same model and tensor
    parallelism, on a GPU when the replicas ask for GPUs. The model's KV geometry from the config
    and the backend's engine arguments are laid over it, as the simulated backend does."""
    model = cfg.model(backend.model)
    assert model is not None  # the config checked its references
    name = demand.profiles.get(backend.name)
    if name is None and backend.kind.caps.profiled:
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
    changes: JSONObject = {}
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
    # The same overlay as cluster.engine.sim_backend.SimBackend.from_config, so that a plan and a sim
    # replica of one backend agree.
    e = backend.engine
    changes: JSONObject = {
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
