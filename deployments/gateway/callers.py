"""Who a request is from, read from its headers once: the surface and tenant it speaks for (from
its API key with auth on; else from ``x-surface`` and ``x-tenant``, a development cluster where
callers say who they are), and whether it is an operator asking for each event's token ids."""

from __future__ import annotations

import hashlib

from cluster.config import ClusterConfig
from cluster.wire.errors import InvalidRequest, Unauthorized
from deployments.gateway import http_api as h
from deployments.internal import token_ok


class Callers:
    def __init__(self, cfg: ClusterConfig, internal_token: str) -> None:
        self.cfg = cfg
        self._keys = {k.sha256: (k.surface, k.tenant) for k in cfg.server.api_keys}
        self._token = internal_token

    def identify(self, scope: h.Scope) -> tuple[str, str | None]:
        """(surface, tenant), or the 401/400 that says why not."""
        if self.cfg.server.auth:
            auth = h.header(scope, b"authorization") or ""
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            found = self._keys.get(hashlib.sha256(key.encode()).hexdigest()) if key else None
            if found is None:
                raise Unauthorized("Missing or invalid API key. Pass it as 'Authorization: Bearer <key>'.")
            return found
        surface = h.header(scope, b"x-surface") or self.cfg.server.default_surface
        if self.cfg.surface(surface) is None:
            known = ", ".join(s.name for s in self.cfg.surfaces)
            raise InvalidRequest(
                f"Unknown surface '{surface[:64]}' in x-surface (known: {known}).", param="x-surface"
            )
        tenant = h.header(scope, b"x-tenant")
        if tenant is not None and self.cfg.tenant(tenant) is None:
            raise InvalidRequest(f"Unknown tenant '{tenant[:64]}' in x-tenant.", param="x-tenant")
        return surface, tenant

    def shows_ids(self, scope: h.Scope) -> bool:
        """An operator's diagnostic (the migration tests and benchmark read them): each event's
        token ids, for a request with ``x-llmc-debug-ids: 1`` and the internal credential."""
        if h.header(scope, b"x-llmc-debug-ids") != "1":
            return False
        return token_ok(h.header(scope, b"x-llmc-internal"), self._token)
