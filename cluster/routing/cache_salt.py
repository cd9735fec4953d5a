"""Per-tenant cache salts: one tenant's prefix cache never answers another tenant's prompt.

Why. A prefix cache shared by everyone is an oracle: a caller who sends someone else's prompt
with a guess filled in learns from ``usage.prompt_tokens_details.cached_tokens`` (or from the
replica cache-aware routing picks, ``x-llmc-replica``) whether the guess is what that prompt
said (issue 47 item 2). So every request carries the salt of its tenant's *cache group*, and the
salt enters every hash that finds a cached block: the engine's own (vLLM's ``cache_salt``, the
simulated engine's in :mod:`cluster.engine.kv`) and the router's
(:class:`cluster.routing.block_hash.BlockHasher`), which keys the prefix index, the sessions'
and the contexts' homes. Equal tokens under different salts are different blocks everywhere.

The groups. A request without a tenant belongs to the anonymous group, which has no salt (its
hashes are the ones every single-tenant workload had before, so their hit rates and benchmarks
stand). Each tenant is a group of its own unless the config puts tenants together
(``tenants[].cache_group``: tenants naming the same group share their cache, e.g. behind one
public system prompt). Requests of one group share as before.

The salt is ``HMAC-SHA256(secret, group)``, truncated to 128 bits as hex: the secret is the
cluster's internal credential (every gateway replica has it, no client does), so a salt cannot be
computed, or guessed, from a tenant's name. vLLM takes at most 128 characters without ``@``,
``/`` or ``\\``; hex is safe. Plain Python, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from cluster.config import TenantConfig

SALT_HEX = 32  # 128 bits: unguessable, and short on the engine wire


def group_key(tenant: str, cache_group: str | None) -> str:
    """The name a tenant's salt is derived from: its configured group, else the tenant itself
    (the prefixes keep a group named like a tenant from sharing that tenant's cache)."""
    return f"group:{cache_group}" if cache_group is not None else f"tenant:{tenant}"


def derive_salt(secret: str, key: str) -> str:
    """The salt of one cache group (``key`` from :func:`group_key`)."""
    if not secret:
        raise ValueError("a cache salt needs a non-empty secret")
    mac = hmac.new(secret.encode(), b"llmc-cache-salt\x00" + key.encode(), hashlib.sha256)
    return mac.hexdigest()[:SALT_HEX]


class CacheSalts:
    """Tenant -> the salt of its cache group (None: the anonymous group, unsalted)."""

    def __init__(self, tenants: Sequence[TenantConfig], secret: str) -> None:
        self._secret = secret
        self._by_tenant = {t.name: derive_salt(secret, group_key(t.name, t.cache_group)) for t in tenants}

    def salt(self, tenant: str | None) -> str | None:
        """The request's salt: None without a tenant; a tenant the config does not list (the
        gateway refuses those) is a group of its own."""
        if tenant is None:
            return None
        found = self._by_tenant.get(tenant)
        return found if found is not None else derive_salt(self._secret, group_key(tenant, None))


def salted_session(session_id: str | None, salt: str | None) -> str | None:
    """A session id in its cache group's namespace: two tenants' sessions of the same id are two
    sessions (neither pins the other to its replica); unchanged without a salt."""
    if session_id is None or salt is None:
        return session_id
    return f"{session_id}:{salt[:12]}"
