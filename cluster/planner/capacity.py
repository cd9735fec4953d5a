"""The capacity planner: peak demand per (model, surface) against provider RPM/TPM caps and against
self-hosted replicas (KV memory, compute, HBM bandwidth), the binding constraint, replicas, GPUs
and money. Pure: a config, a demand file (:mod:`cluster.planner.demand`) and the engine profiles in, a
:class:`Plan` out; what one replica sustains is :mod:`cluster.planner.replica_model`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from cluster.config import (
    ClusterConfig,
    ProviderConfig,
)
from cluster.cost import Prices
from cluster.engine.profiles import Profile
from cluster.json_types import JSON, JSONObject
from cluster.planner.demand import Demand, DemandError, RouteDemand
from cluster.planner.host_cpu import HostCpu, backend_host
from cluster.planner.replica_model import ReplicaModel, Workload, backend_profile


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
    assumptions: JSONObject

    def to_dict(self) -> JSONObject:
        out: JSONObject = _clean(asdict(self))  # asdict gives any field's value
        return out


def _clean(x: JSON) -> JSON:
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
        if backend not in names or not names[backend].kind.caps.engine_replicas:
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
        host = backend_host(cfg.backend(hosted_name))
        hosted = _self_hosted(profiles[hosted_name], hosted_name, d, demand, ttft, frac, host)
        warnings += _hosted_warnings(hosted, profiles[hosted_name], d)

    provider_names = [c for c in dict.fromkeys([primary, *candidates]) if kinds[c] == "provider"]
    providers = [(n, p) for n in provider_names if (p := cfg.backend(n).provider) is not None]
    loads = [_provider_load(p, n, d, demand, frac) for n, p in providers]
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
        primary_kind="self-hosted" if kinds[primary].caps.engine_replicas else "provider",
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


def _hosted_warnings(hosted: SelfHosted, profile: Profile, d: RouteDemand) -> list[str]:
    warnings = []
    p95_len = d.input_tokens.quantile(0.95) + d.output_tokens.quantile(0.95)
    if p95_len > profile.max_model_len():
        warnings.append(
            f"p95 prompt + p95 output ({p95_len:.0f}) exceed {hosted.backend}'s max_model_len "
            f"{profile.max_model_len()}: those requests overflow or get a 400"
        )
    if not hosted.feasible:
        warnings.append(f"{hosted.backend}: {hosted.reason}")
    if hosted.gpus_per_replica == 0:
        warnings.append(f"{hosted.backend}: CPU replicas, no GPU cost counted")
    return warnings


def _gpu_price(demand: Demand, profile: Profile) -> float:
    return demand.gpu_hourly_usd_by_profile.get(profile.name, demand.gpu_hourly_usd)


def _self_hosted(
    profile: Profile,
    backend: str,
    d: RouteDemand,
    demand: Demand,
    ttft_ms: float,
    frac: float,
    host: HostCpu | None = None,
) -> SelfHosted:
    model = ReplicaModel(profile, Workload.from_demand(d, cached_fraction=frac), host)
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
    cost = Prices.from_config(p).usd(i_mean, i_mean * frac, o_mean)
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
        host = backend_host(cfg.backend(hosted.backend))
        after = _self_hosted(profile, hosted.backend, d, demand, ttft_ms, new, host)
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
        prices = Prices.from_config(pc)
        before, after_usd = (prices.usd(i_mean, i_mean * f, o_mean) for f in (frac, new))
        p_saved = (before - after_usd) * per_day
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
