"""A config that loads but is probably not what its operator meant: warnings, never errors.

``cluster check`` prints them and the app builder logs them as it builds the app
(:func:`deployments.app.build_graph`), locally and on Kubernetes alike.
"""

from __future__ import annotations

from cluster.config import ClusterConfig


def config_warnings(cfg: ClusterConfig) -> list[str]:
    """Each warning as one line, naming what it is about."""
    budgeted = [t.name for t in cfg.tenants if t.rpm is not None or t.tpm is not None]
    if cfg.server.auth or not budgeted:
        return []
    names = ", ".join(f"'{n}'" for n in budgeted)
    return [
        f"tenants with budgets ({names}) while server.auth is off: a caller names its own tenant "
        "in x-tenant, and a request that names none is not budgeted at all (turn auth on and give "
        "each key its tenant in server.api_keys)"
    ]
