"""One tenant's prefix cache never answers another's prompt (issue 47 item 2).

The issue's probe: tenant-b sends a confidential prompt naming a company; another caller sends
the same text with two guesses for the name. Before, the right guess came back with the victim's
cached tokens, on the victim's replica (cache-aware routing made it reliable), and the wrong one
with none. Here, on a cluster with auth on, simulated replicas and the engines' KV events feeding
the router: the tab key (no tenant) and tenant-a's key get the same answer for both guesses (no
cached token, a new-prefix decision each), while tenant-b itself, and tenant-c whom the config
puts in tenant-b's cache group, still hit its cache on its replica. vLLM's side (its own prefix
cache honours the salt on the CPU build, its events carry it back) is
``tests/integration/test_tenant_cache_vllm.py``.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import httpx
import pytest

from cluster.config import ClusterConfig, parse_config

pytestmark = pytest.mark.integration

APP, BACKEND, MODEL = "llmc-tenant-cache", "sim-tenants", "m"
KEYS = {who: f"sk-{who}-{secrets.token_hex(16)}" for who in ("tenant-a", "tenant-b", "tenant-c", "tab")}
CLAUSES = " ".join(f"Clause {i}: the board approves the terms." for i in range(8))  # ~170 tokens


def secret_prompt(name: str) -> str:
    """The name comes first: the two guesses share no full block, so an attacker's own first guess
    cannot lend its second one cached tokens (right and wrong are then comparable in any order)."""
    return (
        f"{name} is the company we will acquire next quarter; keep its name out of every channel. {CLAUSES}"
    )


def _config() -> ClusterConfig:
    def key(who: str) -> dict[str, Any]:
        k = {
            "sha256": hashlib.sha256(KEYS[who].encode()).hexdigest(),
            "surface": "tab" if who == "tab" else "chat",
        }
        return k if who == "tab" else {**k, "tenant": who}

    return parse_config(
        {
            "name": APP,
            # one gateway replica: the test reads its exact routing decisions
            "server": {"auth": True, "api_keys": [key(w) for w in KEYS], "gateway_replicas": 1},
            "models": [
                {"name": MODEL, "tokenizer": "@tiny", "context_window": 4096, "default_max_tokens": 2}
            ],
            "backends": [
                {
                    "name": BACKEND,
                    "kind": "sim",
                    "model": MODEL,
                    "replicas": 2,
                    "resources": {"num_cpus": 0.1},
                    "engine": {"block_size": 16},
                }
            ],
            "surfaces": [{"name": "tab", "priority": 0}, {"name": "chat", "priority": 1}],
            "routes": [{"model": MODEL, "candidates": [BACKEND]}],
            "tenants": [
                {"name": "tenant-a"},
                {"name": "tenant-b", "cache_group": "acme-and-partner"},
                {"name": "tenant-c", "cache_group": "acme-and-partner"},
            ],
        }
    )


@pytest.fixture(scope="module")
def app(deploy):
    return deploy(_config(), route_prefix="/tenant-cache")


def _send(app, who: str, name: str) -> tuple[int, str, str]:
    """(cached tokens, replica, the routing decision the gateway made for it)."""
    before = _decisions(app)
    r = httpx.post(
        app.base_url + "/completions",
        json={"model": MODEL, "prompt": secret_prompt(name), "max_tokens": 2},
        headers={"authorization": f"Bearer {KEYS[who]}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    after = _decisions(app)
    made = [reason for reason, n in after.items() if n > before.get(reason, 0)]
    assert len(made) == 1, (before, after)
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], r.headers["x-llmc-replica"], made[0]


def _decisions(app) -> dict[str, int]:
    return dict(app.status()["routing"][BACKEND]["decisions"])


def test_another_tenants_guesses_look_alike_and_the_owners_group_still_hits(app) -> None:
    cached, victim, _ = _send(app, "tenant-b", "Initech")
    assert cached == 0
    # The engine's BlockStored events for it have reached the gateway's index (tenant-b's hashes).
    held = app.wait_status(lambda s: s["routing"][BACKEND]["kv_index"]["replicas"][victim]["blocks"] >= 8)
    assert held["routing"][BACKEND]["kv_index"]["replicas"][victim]["blocks"] >= 8, held["routing"]

    for attacker in ("tab", "tenant-a"):  # no tenant, and another tenant
        wrong = _send(app, attacker, "Globex")
        right = _send(app, attacker, "Initech")
        # Same cached tokens (none), same decision: nothing of tenant-b's cache shows.
        assert (right[0], right[2]) == (wrong[0], wrong[2]) == (0, "new_prefix"), (
            attacker,
            wrong,
            right,
            victim,
        )

    # The owner and its configured group keep their hits, on the replica that holds them.
    for owner in ("tenant-b", "tenant-c"):
        cached, replica, reason = _send(app, owner, "Initech")
        assert cached >= 144 and replica == victim and reason == "prefix", (owner, cached, replica, reason)
