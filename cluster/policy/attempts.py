"""What the gateway does around each attempt of a request, as pure rules: which slots a request's
candidates expand to, and what an attempt's outcome means for the breakers, the hedge delay and
the counters. The gateway (``deployments/gateway/attempts.py``) applies them; tests check them alone.

Slots: a self-hosted backend with more than one replica gets a second slot (``name#2``), so a
retry or a hedge can go to another replica of the same backend (the routing view avoids the
replicas earlier attempts went to) before moving on to the next backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cluster.config import BackendConfig
from cluster.policy.failover import counts_against_backend
from cluster.wire.errors import ClusterError

Verdict = Literal["won", "failed", "cancelled", "broken"]


def backend_of_slot(slot: str) -> str:
    return slot.split("#", 1)[0]


def expand_slots(candidates: list[str], backend: Callable[[str], BackendConfig]) -> list[str]:
    out: list[str] = []
    for name in candidates:
        b = backend(name)
        out.append(name)
        replicas = b.autoscaling.max_replicas if b.autoscaling else b.replicas
        if b.kind.caps.engine_replicas and replicas > 1:
            out.append(f"{name}#2")
    return out


def by_capacity(candidates: list[str], serving: Callable[[str], bool]) -> list[str]:
    """The candidates that can take a request now first (a provider always can), in their order;
    then those with no serving replica, whose attempt would wait for a replacement."""
    ready = [c for c in candidates if serving(c)]
    return ready + [c for c in candidates if c not in ready]


def avoid_replicas(backend: str, prior: list[tuple[str, str | None]]) -> list[str]:
    """The replicas earlier attempts (slot, replica) of this request went to on ``backend``."""
    return [r for slot, r in prior if backend_of_slot(slot) == backend and r]


@dataclass(frozen=True)
class Effects:
    """What one attempt's verdict changes. ``breaker``: record success (True), failure (False) or
    only release a half-open probe slot (None)."""

    breaker: bool | None
    observe_ttft: bool  # its wait says how slow the backend is (a lower bound when cancelled)
    failover: bool = False  # abandoned before a token for the next candidate
    broken: bool = False  # failed after its first token
    hedge_won: bool | None = None  # for a hedge: did it win the race


def effects(verdict: Verdict, err: BaseException | None, hedge: bool) -> Effects:
    if verdict == "won":
        return Effects(True, True, hedge_won=True if hedge else None)
    if verdict == "broken":
        return Effects(False, False, broken=True)
    if verdict == "failed":
        against = err is not None and counts_against_backend(err)
        return Effects(False if against else None, False, failover=True)
    return Effects(None, True, hedge_won=False if hedge else None)  # cancelled: lost, or client left


def error_code(err: BaseException | None) -> str:
    if isinstance(err, ClusterError):
        return err.code or ""
    return type(err).__name__ if err is not None else ""
