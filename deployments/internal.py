"""The cluster's internal credential: engine replicas serve their token streams only to callers
that present it (the gateway), so an engine port reached from inside the network is not an open
API. It comes from ``LLMC_INTERNAL_TOKEN`` (the local launcher sets one; on Kubernetes a Secret);
without it, from Ray's own cluster auth token (Ray 2.60 turns token auth on, and every process
of the cluster can read it), so one Ray cluster always agrees on it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from cluster.dataplane import INTERNAL_TOKEN_ENV as ENV


def internal_token() -> str:
    token = os.environ.get(ENV, "").strip()
    if token:
        return token
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), str(Path.home() / ".ray" / "auth_token")):
        if path and Path(path).is_file() and (raw := Path(path).read_text().strip()):
            return hashlib.sha256(b"llmc-internal:" + raw.encode()).hexdigest()
    raise RuntimeError(
        f"no internal credential: set {ENV} on every node (the gateway and the engine replicas must "
        "share it), or run Ray with token auth (RAY_AUTH_TOKEN_PATH)"
    )


def curve_keys(token: str) -> tuple[bytes, bytes]:
    """The KV-event publishers' CURVE key pair (public, secret; Z85), derived from the internal
    credential: a gateway needs the credential to know the publishers' public key, without which
    its handshake fails (:mod:`deployments.engine.kv_pub`)."""
    import zmq
    from zmq.utils import z85

    secret = z85.encode(hashlib.sha256(b"llmc-kv-pub:" + token.encode()).digest())
    return zmq.curve_public(secret), secret


def token_ok(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def debug_ids_headers() -> dict[str, str]:
    """An operator's request for each streamed event's token ids (the gateway strips them for every
    other client): the migration tests and benchmark compare streams token by token with them."""
    return {"x-llmc-internal": internal_token(), "x-llmc-debug-ids": "1"}
