"""The ``server`` section of the cluster config: where the API listens, its limits on clients,
API keys, the gateway replicas (re-exported by :mod:`cluster.config`)."""

from __future__ import annotations

from pydantic import Field

from cluster.base import Strict


class ApiKey(Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex SHA-256 of the key (never the key).")
    surface: str = Field(description="Surface the key's requests belong to.")
    tenant: str | None = Field(None, description="Tenant (from `tenants`) billed for the key's requests.")


class ServerConfig(Strict):
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, gt=0, lt=65536, description="HTTP port.")
    metrics_port: int = Field(
        8080, gt=0, lt=65536, description="Prometheus port of Ray's metrics agent (GET /metrics), each node."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Request bodies above this get a 413.")
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A client's request line and headers must arrive within this; past it HAProxy answers "
        "408 and closes (its `timeout http-request`; `cluster serve`, set when it starts Ray).",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request body must arrive in full within this, from when the gateway starts reading "
        "it; past it the gateway answers 408 (a slow or stalled upload holds no connection longer).",
    )
    max_conns_per_client: int | None = Field(
        1024,
        gt=0,
        description="Open connections one client address may hold at HAProxy; more are refused as they "
        "open (`cluster serve`, set when it starts Ray). None: no limit but HAProxy's own maxconn.",
    )
    auth: bool = Field(False, description="Require API keys (maps keys to surfaces).")
    api_keys: list[ApiKey] = Field(default_factory=list, description="Accepted keys, hashed.")
    default_surface: str = Field("chat", description="Surface for requests that name none.")
    gateway_replicas: int = Field(
        2, ge=1, description="Gateway replicas (HAProxy spreads clients over them; two survive one's loss)."
    )
    gc_freeze: bool = Field(
        True,
        description="Freeze each gateway and engine replica's startup heap (gc.freeze) so that Python's "
        "full collections, which stop the process, walk only what requests allocated since.",
    )
    gateway_nice: int | None = Field(
        None,
        ge=-20,
        le=19,
        description=(
            "Niceness of each gateway replica and of its node's HAProxy (Ray starts workers at 15). On a "
            "host shared with engines and clients, 0 stops the router waiting behind every nice-0 process "
            "there; lowering it needs CAP_SYS_NICE (refused: kept, said in /internal/status). None: Ray's."
        ),
    )

    timing_header: bool = Field(
        True,
        description="Send each completion's Server-Timing header (prep, queue, upstream, ttft in ms): the "
        "gateway's share of the time to the first token against the backend's.",
    )

    @property
    def router_replicas(self) -> int:
        """Admission divides every limit between the gateway replicas (each enforces its share)."""
        return self.gateway_replicas
