"""The one typed config that drives the cluster, the planner, the manifests and the load tests.

Every model here is pydantic v2 with ``extra="forbid"`` so that a misspelt key is an error that
names the field, caught when the file is loaded rather than when the first request arrives.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from cluster.backend_kind import BackendKind
from cluster.base import ConfigError as ConfigError
from cluster.base import Strict, read_yaml, validate
from cluster.engine.args import EngineArgs as EngineArgs
from cluster.engine.sim_options import SimOptions
from cluster.json_types import JSON, JSONObject
from cluster.policy.brownout import BrownoutConfig
from cluster.policy.failover import FailoverConfig
from cluster.policy.hedging import HedgeConfig
from cluster.policy.migration import MigrationConfig
from cluster.policy.slo_guard import SloGuardConfig
from cluster.server_config import ApiKey as ApiKey
from cluster.server_config import ServerConfig as ServerConfig

TINY_MODEL_PATH = "@tiny"  # resolved to the locally built random-weight model (cluster.engine.tiny_model)


class KVGeometry(Strict):
    layers: int = Field(gt=0, description="Transformer layers that hold a KV cache.")
    kv_heads: int = Field(gt=0, description="Key/value heads per layer (GQA groups).")
    head_dim: int = Field(gt=0, description="Dimension of one attention head.")
    dtype_bytes: int = Field(2, gt=0, description="Bytes per KV element (2 for bf16/fp16, 1 for fp8).")

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


class FimTemplate(Strict):
    """How the model itself spells fill-in-the-middle (its own special tokens, from its card)."""

    prefix: str = Field(min_length=1, description="The token before the code ahead of the cursor.")
    suffix: str = Field(min_length=1, description="The token before the code after the cursor.")
    middle: str = Field(min_length=1, description="The token after which the model writes the middle.")
    order: Literal["psm", "spm"] = Field(
        "psm", description="psm: prefix, suffix, middle (most models); spm: suffix first."
    )


class ToolCallsConfig(Strict):
    """How a self-hosted model writes tool calls: the format its chat template teaches and our
    parser reads (:mod:`cluster.wire.tool_parser`)."""

    format: Literal["hermes"] = Field(
        "hermes", description="The call format: 'hermes' is <tool_call>{name, arguments}</tool_call>."
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template that renders tools, calls and tool results in that format "
        "(None: the tokenizer's own, which must).",
    )


class ModelConfig(Strict):
    name: str = Field(min_length=1, description="Model id served at /v1/models and asked for in requests.")
    tokenizer: str = Field(
        description=(
            "How to count this model's tokens: a HF tokenizer folder, '@tiny' for the local model, "
            "'tiktoken:<encoding or model>' for OpenAI models, or 'estimate:<chars per token>'."
        )
    )
    path: str | None = Field(None, description="Weights for self-hosted engines: a folder, or '@tiny'.")
    context_window: int = Field(gt=0, description="Maximum prompt + completion tokens.")
    params_b: float | None = Field(None, gt=0, description="Parameters in billions (planner, sim).")
    kv: KVGeometry | None = Field(None, description="KV-cache geometry (planner, sim).")
    overflow_to: str | None = Field(
        None, description="A bigger-window model to route to when a request does not fit; else 400."
    )
    default_max_tokens: int | None = Field(
        None,
        gt=0,
        description="max_tokens when the request gives none; None: the rest of the context window, as "
        "OpenAI and vLLM. Set it where the model's own output limit is below its window (a provider "
        "refuses more) or the model never stops on its own (random weights, sims); an answer it "
        "shortens carries x-llmc-max-tokens-capped.",
    )
    fim: FimTemplate | None = Field(
        None, description="FIM tokens: /v1/completions with 'suffix' on self-hosted engines; else a 400."
    )
    tool_calls: ToolCallsConfig | None = Field(
        None,
        description="Self-hosted engines serve tools (the template renders them, our parser reads "
        "the calls); None: tools on engines are a 400.",
    )
    accepts_images: bool = Field(
        True,
        description="False: a text-only model; image parts are a 400 naming the field on every backend "
        "(engines refuse them anyway).",
    )


class ProviderConfig(Strict):
    api: Literal["openai", "anthropic"] = Field(description="Wire protocol the provider speaks.")
    base_url: str = Field(description="Base URL, e.g. https://api.openai.com/v1 .")
    upstream_model: str | None = Field(None, description="Model name the provider expects (default: ours).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key (never the key)."
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP/TLS connect timeout.")
    first_token_timeout_s: float = Field(
        30.0, gt=0, description="Time allowed until the first content token."
    )
    between_tokens_timeout_s: float = Field(30.0, gt=0, description="Longest silence allowed mid-stream.")
    total_timeout_s: float = Field(600.0, gt=0, description="Whole-request limit.")
    rpm: int | None = Field(None, gt=0, description="Requests per minute budget (None: unlimited).")
    tpm: int | None = Field(None, gt=0, description="Tokens per minute budget, input + max output.")
    max_in_flight: int | None = Field(None, gt=0, description="Concurrent requests allowed upstream.")
    cost_per_mtok_input: float = Field(0.0, ge=0, description="USD per 1M uncached input tokens.")
    cost_per_mtok_cached_input: float = Field(0.0, ge=0, description="USD per 1M cached input tokens.")
    cost_per_mtok_output: float = Field(0.0, ge=0, description="USD per 1M output tokens.")
    cost_per_mtok_cache_write: float | None = Field(
        None,
        ge=0,
        description="USD per 1M prompt-cache write tokens (Anthropic's cache_creation_input_tokens; "
        "1.25x input for the 5-minute cache); unset: the input price.",
    )


class Resources(Strict):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per replica (bookkeeping on CPU hosts).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica.")
    memory_bytes: int | None = Field(None, gt=0, description="Ray memory reservation per replica.")


class Autoscaling(Strict):
    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept up.")
    max_replicas: int = Field(1, ge=1, description="Most replicas started.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Target in-flight requests per replica (default: derived from max_num_seqs)."
    )


class AffinityConfig(Strict):
    """The cache-aware policy's knobs (``routing: cache_aware``); cluster/routing/affinity.py says what
    each does. ``min_match_ratio`` 0.5 and ``new_prefix: home`` are the defaults here (not in the
    pure AffinityParams) because loadtest/benchmarks/bench_affinity.py measured them better under KV pressure
    and no worse when the contexts fit, behind one gateway replica or two (BENCHMARKS.md, issue 17)."""

    min_match_tokens: int = Field(
        64,
        ge=1,
        description="A cached prefix shorter than this does not steer a request (template boilerplate).",
    )
    min_match_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A cached prefix must also cover this share of the prompt's blocks to steer.",
    )
    load_factor: float = Field(
        1.25,
        ge=1,
        description="Bounded load: no replica takes more than this times the average in flight ...",
    )
    load_slack: int = Field(
        8, ge=0, description="... unless it is within this many requests of the least loaded."
    )
    new_prefix: Literal["rendezvous", "least_loaded", "home"] = Field(
        "home",
        description=(
            "Where a prompt with no useful cached prefix goes: its home by rendezvous hashing of the session "
            "id or first blocks (concurrent sharers converge), the least loaded eligible replica whose "
            "cache is least full, or (home) its context's sticky home, new contexts to the replica with the "
            "least hot demand per KV block (cluster/routing/placement.py)."
        ),
    )
    home_half_life_requests: float = Field(
        256.0,
        gt=0,
        description="new_prefix home: a replica's hot demand halves over this many requests to the backend.",
    )
    kv_events: bool = Field(
        True,
        description=(
            "Feed the prefix index from the engines' KV events (vLLM's kv_events_config publisher; the sim "
            "publishes the same), so it holds what each replica has cached; off: the routed-record guess."
        ),
    )
    kv_transport: Literal["push", "poll"] = Field(
        "push",
        description=(
            "How the engine replicas' KV events reach the gateways: push, each page sent once on a ZMQ "
            "PUB socket every gateway subscribes to (the log asked only after a miss); poll, every "
            "gateway long-polls every engine's log (N x M HTTP asks; control_plane.json)."
        ),
    )
    kv_index: Literal["gateway", "indexer"] = Field(
        "gateway",
        description=(
            "Where the engines' KV events are applied: gateway, by every gateway replica (each holds "
            "the whole index); indexer, once by indexer deployments (indexer_shards of them, each the "
            "anchors h % shards), whose frames of what changed every gateway mirrors "
            "(cluster/routing/index_mirror.py; control_plane.json's indexer rows). Needs kv_events."
        ),
    )
    indexer_shards: int = Field(
        1, ge=1, le=64, description="kv_index indexer: how many indexers share the anchors (h % shards)."
    )
    recent_ttl_s: float = Field(
        5.0,
        gt=0,
        description="With KV events: how long a sent request's blocks count before events confirm them.",
    )
    cache_priority: bool = Field(
        True,
        description=(
            "Within a surface, the engine runs a request whose context its cache holds before waiting "
            "ones whose context it does not (needs scheduling_policy: priority). Under KV pressure a "
            "queued request's context is otherwise evicted before it runs (BENCHMARKS.md, issue 17)."
        ),
    )
    decision_candidates: int = Field(
        8,
        ge=0,
        description=(
            "A decision over more replicas than this scores only the session's, the prompt's deepest "
            "cached-prefix holders, its home and this many drawn at random (exact at or below it; "
            "cluster/routing/candidates.py); 0: every replica."
        ),
    )
    index_capacity_blocks: int = Field(
        1_000_000,
        ge=1,
        description=(
            "Entries the prefix index, its last-stored-by map and the homes each hold per gateway replica "
            "(anchors: one per claim_stride_blocks blocks): bounds the index's memory whatever the fleet "
            "(control_plane.json's index_bytes_per_block)."
        ),
    )
    claim_stride_blocks: int = Field(
        8,
        ge=1,
        description=(
            "The engines publish, and the index, homes and recent sends keep, every k-th block of a "
            "chain and its last (k times fewer hashes for every gateway to apply, depths known to "
            "within k blocks; cluster/routing/event_hashes.py); 1: every block."
        ),
    )

    @model_validator(mode="after")
    def _indexer_needs_events(self) -> AffinityConfig:
        if self.kv_index == "indexer" and not self.kv_events:
            raise ValueError("kv_index 'indexer' applies the engines' KV events: it needs kv_events true")
        if self.kv_index == "indexer" and self.new_prefix == "least_loaded":
            raise ValueError(
                "kv_index 'indexer' mirrors the index and the homes, not the last-stored map that "
                "new_prefix 'least_loaded' reads: use 'home' or 'rendezvous'"
            )
        return self

    def params(self) -> JSONObject:
        """The fields :class:`cluster.routing.affinity.AffinityParams` takes."""
        return self.model_dump(exclude={"kv_events", "kv_transport", "kv_index", "indexer_shards"})


class HostCpuConfig(Strict):
    """Planner only: the host CPU a CPU engine's replicas share with their serving stack (see
    cluster/planner/host_cpu.py). Leave it out on GPUs."""

    cores: float = Field(gt=0, description="Cores of the host the replicas and their serving stack share.")
    engine_cores_per_step: float = Field(
        ge=0, description="Cores an engine keeps busy while a step runs (its compute threads)."
    )
    serving_cpu_ms_per_token: float = Field(
        ge=0,
        description="CPU ms per streamed token outside the engine cores: replica, gateway, proxy, client.",
    )
    serving_cpu_ms_per_request: float = Field(
        0.0, ge=0, description="CPU ms per request outside the engine cores (parsing, routing, connections)."
    )
    background_cores: float = Field(0.0, ge=0, description="Cores busy whatever the load (Ray, idle loops).")
    measured: str | None = Field(None, description="Where the figures come from (a calibration run).")

    @model_validator(mode="after")
    def _some_cores_left(self) -> HostCpuConfig:
        if self.background_cores >= self.cores:
            raise ValueError(f"background_cores ({self.background_cores}) must be below cores ({self.cores})")
        return self


class BackendConfig(Strict):
    name: str = Field(min_length=1, description="Backend id, used in routes and metrics.")
    kind: BackendKind = Field(description="What serves the requests: vllm, sim or provider.")
    model: str = Field(description="The model (from `models`) this backend serves.")
    replicas: int = Field(1, ge=1, description="Replicas when not autoscaling.")
    autoscaling: Autoscaling | None = Field(None, description="Serve autoscaling instead of fixed replicas.")
    resources: Resources = Field(default_factory=Resources, description="Ray resources per replica.")
    max_in_flight_per_replica: int = Field(64, gt=0, description="Router-side cap on requests per replica.")
    routing: Literal["cache_aware", "least_loaded", "round_robin", "power_of_two"] = Field(
        "cache_aware",
        description=(
            "Replica choice, made by the gateway: ours (cache_aware), or a baseline for benchmarks: "
            "least_loaded, round_robin, power_of_two (two random replicas, the less loaded)."
        ),
    )
    affinity: AffinityConfig = Field(
        default_factory=AffinityConfig, description="Cache-aware routing policy (self-hosted backends)."
    )
    engine: EngineArgs = Field(default_factory=EngineArgs, description="vLLM engine arguments (kind vllm).")
    sim_profile: str | None = Field(None, description="Engine-model profile name (kind sim).")
    sim_options: SimOptions = Field(
        default_factory=SimOptions, description="Sim knobs: speedup, injected faults and latency (kind sim)."
    )
    provider: ProviderConfig | None = Field(None, description="Provider endpoint (kind provider).")
    host_cpu: HostCpuConfig | None = Field(
        None, description="Planner only: the host CPU every replica shares (CPU engines on one host)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment variables set in the replica's process at start (not secrets: those come from "
            "the pod's environment, e.g. a Kubernetes Secret)."
        ),
    )

    @model_validator(mode="after")
    def _kind_fields(self) -> BackendConfig:
        if not self.kind.caps.engine_replicas and self.provider is None:
            raise ValueError("a backend of kind 'provider' needs a 'provider' section")
        if self.kind.caps.engine_replicas and self.provider is not None:
            raise ValueError(f"'provider' is only for kind 'provider', not '{self.kind}'")
        return self


class SurfaceConfig(Strict):
    name: str = Field(min_length=1, description="Product surface id (tab, chat, agent …).")
    priority: int = Field(0, description="Lower is served first when requests queue.")
    ttft_slo_ms: float = Field(1000.0, gt=0, description="Time-to-first-token objective.")
    max_concurrency: int = Field(64, gt=0, description="Requests of this surface in flight at once.")
    max_queue: int = Field(256, ge=0, description="Requests allowed to wait for a slot.")
    queue_deadline_ms: float = Field(2000.0, gt=0, description="Longest queue wait before a 429.")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline for the whole request.")
    hedging: bool = Field(False, description="Race a second backend when the first token is late.")
    avoid_prefill_tokens: int | None = Field(
        None,
        gt=0,
        description="Route this surface's requests away from engine replicas where this gateway's "
        "requests still waiting for their first token hold at least this many uncached prompt tokens, "
        "while another replica is below it: a short prompt there waits for a long prefill's step "
        "(cluster/routing/view.py). None: route by cache and load alone.",
    )
    max_output_tokens: int | None = Field(
        None,
        gt=0,
        description="Most completion tokens a request of this surface gets: a larger max_tokens, or "
        "none (the rest of the window), is lowered to it and the answer carries "
        "x-llmc-max-tokens-capped. None: no cap.",
    )


class RouteConfig(Strict):
    model: str = Field(description="Model id the route serves.")
    surface: str | None = Field(None, description="Only for this surface (None: every surface).")
    candidates: list[str] = Field(min_length=1, description="Backends in the order they are tried.")


class TenantConfig(Strict):
    name: str = Field(min_length=1, description="Tenant id (a customer, a team, an agent fleet).")
    rpm: int | None = Field(None, gt=0, description="Requests per minute across its keys (None: unlimited).")
    tpm: int | None = Field(
        None, gt=0, description="Tokens per minute, prompt + max_tokens reserved, settled with usage."
    )
    weight: float = Field(
        1.0, gt=0, description="Fair-queuing weight: its share of a surface's freed slots when tenants queue."
    )
    burst_s: float = Field(
        60.0,
        gt=0,
        le=60,
        description="Seconds of its request budget a tenant may spend at once: its request bucket holds "
        "burst_s/60 of its rpm (at least one request) and refills at rpm per minute. 60: a whole "
        "minute's requests at once; lower it so a runaway loop cannot spend its minute in its first "
        "seconds beside other tenants (the noisy-neighbour benchmark, BENCHMARKS.md). Its token "
        "budget keeps a minute's bucket, so that one large request still fits its tpm.",
    )
    cache_group: str | None = Field(
        None, description="Tenants naming one group share their prefix cache; None: a cache of its own."
    )


class PolicyConfig(Strict):
    stream_idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Silence after the first token that ends a stream (or migrates it: migration).",
    )
    failover: FailoverConfig = Field(
        default_factory=FailoverConfig, description="Circuit breakers, retry budget, attempt limits."
    )
    hedging: HedgeConfig = Field(
        default_factory=HedgeConfig, description="Hedge delay (TTFT quantile or fixed) and hedge budget."
    )
    slo_guard: SloGuardConfig = Field(
        default_factory=SloGuardConfig,
        description="Cap lower-priority work on a backend while the top surface's TTFT nears its SLO.",
    )
    brownout: BrownoutConfig = Field(
        default_factory=BrownoutConfig,
        description="Put a backend whose recent TTFT is far above its own usual behind the other candidates.",
    )
    migration: MigrationConfig = Field(
        default_factory=MigrationConfig,
        description="Continue a self-hosted stream that broke after its first token on another replica.",
    )


class TracingConfig(Strict):
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); None: tracing off."
    )
    service_name: str = Field("llm-cluster", description="The service.name resource attribute.")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Share of requests traced.")
    export_delay_ms: float = Field(1000.0, gt=0, description="Longest wait before a batch of spans goes.")
    export_timeout_s: float = Field(10.0, gt=0, description="Per-export HTTP timeout.")


class ClusterConfig(Strict):
    name: str = Field("llm-cluster", description="Serve application name.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP ingress settings.")
    models: list[ModelConfig] = Field(min_length=1, description="Models served.")
    backends: list[BackendConfig] = Field(min_length=1, description="Engines and providers.")
    surfaces: list[SurfaceConfig] = Field(min_length=1, description="Product surfaces and their limits.")
    routes: list[RouteConfig] = Field(default_factory=list, description="Candidate backends per model.")
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="Tenants API keys belong to: budgets and fair-queuing weights."
    )
    policies: PolicyConfig = Field(default_factory=PolicyConfig, description="Failover and hedging policies.")
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry traces per request (off by default)."
    )

    @model_validator(mode="after")
    def _references(self) -> ClusterConfig:
        models = _by_name("models", self.models)
        backends = _by_name("backends", self.backends)
        surfaces = _by_name("surfaces", self.surfaces)
        for i, b in enumerate(self.backends):
            if b.model not in models:
                raise ValueError(f"backends[{i}].model: unknown model '{b.model}'")
        for i, m in enumerate(self.models):
            if m.overflow_to is not None and m.overflow_to not in models:
                raise ValueError(f"models[{i}].overflow_to: unknown model '{m.overflow_to}'")
        for i, r in enumerate(self.routes):
            if r.model not in models:
                raise ValueError(f"routes[{i}].model: unknown model '{r.model}'")
            if r.surface is not None and r.surface not in surfaces:
                raise ValueError(f"routes[{i}].surface: unknown surface '{r.surface}'")
            for c in r.candidates:
                if c not in backends:
                    raise ValueError(f"routes[{i}].candidates: unknown backend '{c}'")
                if backends[c].model != r.model:
                    raise ValueError(
                        f"routes[{i}].candidates: backend '{c}' serves '{backends[c].model}', not '{r.model}'"
                    )
        if self.server.default_surface not in surfaces:
            raise ValueError(f"server.default_surface: unknown surface '{self.server.default_surface}'")
        tenants = _by_name("tenants", self.tenants)
        for i, k in enumerate(self.server.api_keys):
            if k.surface not in surfaces:
                raise ValueError(f"server.api_keys[{i}].surface: unknown surface '{k.surface}'")
            if k.tenant is not None and k.tenant not in tenants:
                raise ValueError(f"server.api_keys[{i}].tenant: unknown tenant '{k.tenant}'")
        return self

    # Lookups -------------------------------------------------------------------------------
    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def backend(self, name: str) -> BackendConfig:
        return next(b for b in self.backends if b.name == name)

    def surface(self, name: str) -> SurfaceConfig | None:
        return next((s for s in self.surfaces if s.name == name), None)

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def candidates(self, model: str, surface: str) -> list[str]:
        """Backends to try for a model and surface: a surface-specific route wins over a general one;
        with no route at all, every backend serving the model, in config order."""
        specific = [r for r in self.routes if r.model == model and r.surface == surface]
        general = [r for r in self.routes if r.model == model and r.surface is None]
        for group in (specific, general):
            if group:
                return list(group[0].candidates)
        return [b.name for b in self.backends if b.model == model]


def _by_name(what: str, items: list[JSON]) -> JSONObject:
    seen: JSONObject = {}
    for item in items:
        if item.name in seen:
            raise ValueError(f"{what}: duplicate name '{item.name}'")
        seen[item.name] = item
    return seen


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    return parse_config(read_yaml(path, expand_env=True), source=str(Path(path)))


def parse_config(raw: JSON, source: str = "<config>") -> ClusterConfig:
    return validate(ClusterConfig, raw, source, "config")
