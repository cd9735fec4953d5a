"""One admitted request as the relay serves it (:class:`RequestContext`, immutable), and what its
serving came to (:class:`Served`, the relay's return value)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.observability.trace import RequestTrace
from cluster.policy.admission_types import Outcome
from cluster.wire.protocol import Usage
from deployments.gateway.prepare import Prepared


@dataclass(frozen=True)
class RequestContext:
    """Everything per request that the relay and a migration read; nothing writes it. ``trace`` is
    the request's trace when it is sampled (the relay stamps its first token and end in it)."""

    prepared: Prepared
    candidates: list[str]  # the backends to try, in order (admission's pick first)
    t0: float  # the request's arrival (perf_counter)
    waited_s: float  # its wait in the admission queue
    trace: RequestTrace | None = None
    # The tenant's reservation settles with the tokens the request spent (called once, however it
    # ends: completed, errored or cancelled); None: the tenant has no budget
    settle: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Served:
    """How a request ended, as the relay measured it."""

    outcome: Outcome
    usage: Usage | None  # as the backend reported it (None: it reported none)
    cost_usd: float  # a provider's price of that usage (0 for engines)
    finish: str | None  # the finish reason (None: no token reached the client)
    spent_tokens: int  # what the tenant's reservation settled with (usage, or what was spent)
