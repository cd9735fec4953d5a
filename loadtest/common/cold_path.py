"""What one request's own code costs when the CPU comes to it cold (issue 44's short streams).

At one stream a relay's added TTFT is its per-request code run once, after the core sat idle (or
ran HAProxy, the upstream, the client) since the request before. On these 2-core VMs that code
then runs from cold caches, several times slower than the same code in a loop: a microbenchmark
of a hot loop understates what a request costs. Phase stamps taken inside a gateway replica at one
stream (a diagnosis, not kept) read each phase's thread CPU time equal to its wall time, and about
what :func:`cold_and_hot` measures here for the same code after an idle pause.

:func:`cold_and_hot` times one call hot (back to back) and cold (after ``idle_s`` asleep), p50 of
each; :func:`prepare_cold_and_hot` applies it to the gateway's :func:`deployments.gateway.prepare.prepare`
of the overhead benchmark's request under its cluster's config, in the benchmark's own process (same
interpreter, same box, same run). A figure for ``overhead.json``; nothing here is a goal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig

IDLE_S = 0.002  # about one request's gap at one stream through a relay here
WARM_CALLS = 50


def cold_and_hot(
    fn: Callable[[], object],
    rounds: int = 200,
    idle_s: float = IDLE_S,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, float]:
    """``fn``'s p50 time in µs called back to back (``hot_us``) and each call after ``idle_s``
    asleep (``cold_us``), after ``WARM_CALLS`` calls that load it; ``cold_factor`` = cold / hot."""
    for _ in range(WARM_CALLS):
        fn()
    hot: list[float] = []
    for _ in range(rounds):
        t = clock()
        fn()
        hot.append(clock() - t)
    cold: list[float] = []
    for _ in range(rounds):
        sleep(idle_s)
        t = clock()
        fn()
        cold.append(clock() - t)
    # the factor from the figures as reported, so that the three always agree
    hot_us, cold_us = round(statistics.median(hot) * 1e6, 1), round(statistics.median(cold) * 1e6, 1)
    return {
        "idle_ms": round(idle_s * 1e3, 3),
        "hot_us": hot_us,
        "cold_us": cold_us,
        "cold_factor": round(cold_us / hot_us, 2) if hot_us > 0 else float("nan"),
    }


def prepare_cold_and_hot(cfg: ClusterConfig, body: bytes, rounds: int = 200) -> dict[str, Any]:
    """:func:`cold_and_hot` of the gateway's request preparation (parse, validate, tokenize with the
    model's tokenizer, fit the context, pick candidates) of ``body`` under ``cfg``."""
    from cluster.wire.protocol import ChatCompletionRequest
    from deployments.gateway.prepare import prepare

    surface = cfg.server.default_surface

    def once() -> object:
        return prepare(cfg, body, ChatCompletionRequest, "chat", "cold-path", surface, None, {}, None)

    return {"what": "deployments.gateway.prepare.prepare", **cold_and_hot(once, rounds)}
