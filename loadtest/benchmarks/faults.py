"""Faults under load: while a bounded load of mixed surfaces runs, break one thing at a time and
record how every request in flight ended and how long the cluster took to serve normally again.

Faults, in order: one of the two gateway replicas' actor killed (the process that serves the
clients' HTTP connections, HAProxy in front); a simulated replica's actor killed (Serve restarts
both); the OpenAI provider stalling mid-stream; the OpenAI provider answering 429, then 500, for a
window; the Anthropic provider answering 529 for a window.

For each fault, the *cohort* is every request in flight when it was injected or started before the
cluster had recovered; each ended as one of: ``completed`` (by its first-choice backend),
``failed_over`` (by another), ``error_event`` (a terminal SSE error after tokens), ``error_status``
(an OpenAI error with an HTTP status), ``cancelled`` (by the client, on purpose), ``conn_error``,
``truncated`` (a stream that ended without its end marker) or ``hung`` (no end by the surface's
deadline plus a margin: must be 0). A gateway replica serves its clients' HTTP connections itself
(HAProxy in front), so when one is killed the streams it was serving lose their connection
(``conn_error``): ``kill`` in that fault's result says how many may (the victim's requests in flight
when it was killed) and how many did, and when they started. ``recovery_s``: from the fault's end
until three probes in a row were served as normal (by the first-choice backend where that is the
point); ``restored_s``: until the killed deployment had all its replicas running again.

The CI tier runs the short form (tests/reliability/test_faults.py); by hand, a longer one:

    .venv/bin/python -m loadtest.benchmarks.faults [--long] [--out loadtest/results/faults.json]

starts its own local cluster and loopback providers on free ports, and writes the summary JSON and a
Markdown table (``--markdown``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.common.actor_probe import (
    GATEWAY,
    gateway_counters,
    gateway_policies,
    kill_actor,
    replaced,
    replica_ids,
    wait_idle,
)
from loadtest.common.provenance import git_state, provenance
from loadtest.common.reliability import (
    ANTHROPIC_BACKEND,
    MIX_SHAPES,
    OPENAI_BACKEND,
    SIM_BACKEND,
    Keys,
    Load,
    Record,
    Shape,
    loopback_app,
    probe,
    wait_until,
)

# The kills first: Serve's restart of a replica (tens of seconds here for the gateway, which loads
# its tokenizers) is watched in the background while the next faults run.
FAULTS = [
    "kill_gateway",
    "kill_sim_replica",
    "provider_stall",
    "provider_429",
    "provider_500",
    "anthropic_529",
]
RESTORE_TIMEOUT_S = 180.0
GATEWAY_REPLICAS = 2  # reliability_config's default
OUTCOMES = [
    "completed",
    "failed_over",
    "error_event",
    "error_status",
    "cancelled",
    "conn_error",
    "truncated",
    "hung",
]
ERRORED = ("error_event", "error_status", "conn_error", "truncated")
RESULTS = Path(__file__).parents[1] / "results"


@dataclass(frozen=True)
class Scale:
    workers: int
    warmup_s: float
    window_s: float  # how long a provider fault lasts
    stalls: int  # requests the stalling provider takes
    settle_s: float  # load kept running after recovery before the next fault
    recovery_timeout_s: float
    repeats: int


SHORT = Scale(workers=5, warmup_s=3, window_s=3, stalls=4, settle_s=1, recovery_timeout_s=40, repeats=1)
LONG = Scale(workers=8, warmup_s=10, window_s=10, stalls=10, settle_s=3, recovery_timeout_s=90, repeats=2)

PROBE_OPENAI = Shape("probe-openai", "/chat/completions", "rel-mix", "chat", True, 4)
PROBE_SIM = Shape("probe-sim", "/chat/completions", "rel-mix", "agent", True, 4)
PROBE_CLAUDE = Shape("probe-claude", "/chat/completions", "rel-claude", "chat", False, 4)


class FaultRun:
    """One app under one load; ``run(name)`` injects a fault and measures it."""

    def __init__(self, app: str, base_url: str, keys: Keys, oai: Any, ant: Any, scale: Scale) -> None:
        self.app, self.base_url, self.keys = app, base_url, keys
        self.url = base_url.removesuffix("/v1")  # the app's URL (its route prefix): internal status
        self.oai, self.ant, self.scale = oai, ant, scale
        self.load = Load(
            base_url, keys, workers=scale.workers, shapes=MIX_SHAPES, max_s=1800, max_requests=50_000
        )
        self.counters_before_gateway_kill: dict[str, Any] | None = None
        self.gateway_killed: str | None = None
        self.gateway_replicas_at_kill: list[str] = []  # live (named) gateway replicas at the kill
        # (counters read, ray.kill called, process seen gone)
        self.gateway_kill_times: tuple[float, float, float | None] | None = None
        self.probes: list[Record] = []  # they reach the providers too: part of the accounting
        self.watchers: list[threading.Thread] = []
        self.killed: dict[str, list[str]] = {}  # deployment -> the replicas this run killed

    # -- what "normal" means -------------------------------------------------------------------
    def _served(self, shape: Shape, backend: str | None) -> Callable[[], bool]:
        def ok() -> bool:
            r = probe(self.base_url, self.keys, shape)
            self.probes.append(r)
            return r.outcome in ("completed", "failed_over") and (backend is None or r.backend == backend)

        return ok

    # -- faults: each returns (fault end time, "normal" predicate, "restored" predicate or None) ---
    def _whole(self, deployment: str, replicas: int) -> bool:
        """Before a kill: the deployment has all its replicas again, the ones this run killed
        replaced (a repeat waits for the last restart). Serve's status alone is not enough: it goes
        on counting a killed replica RUNNING until a health check fails (19 s after a gateway kill
        here), so a repeat that trusted it killed the only live gateway (issue 15: the "hang after
        the second gateway kill" was the whole ingress down while a replacement started)."""
        killed = self.killed.get(deployment, [])
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # the controller is busy: look again
                if replaced(self.app, deployment, killed, replicas):
                    return True
            time.sleep(0.25)
        return False

    def _kill(self, deployment: str, victim: str) -> tuple[float, float | None]:
        self.killed.setdefault(deployment, []).append(victim)
        return kill_actor(self.app, deployment, victim)

    def _kill_sim_replica(self) -> tuple[float, Callable[[], bool], Callable[[], bool] | None]:
        from deployments.launcher.local import replica_stats

        deployment = f"backend-{SIM_BACKEND}"
        deadline = time.monotonic() + 5  # wait (a little) for a replica with streams in flight
        while True:
            sims = [s for s in replica_stats(self.url).values() if s.backend == SIM_BACKEND]
            busy = max(sims, key=lambda s: s.running, default=None)
            if (busy is not None and busy.running > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        victim = busy.replica if busy is not None else replica_ids(self.app, deployment)[0]
        self._kill(deployment, victim)
        restored = lambda: replaced(self.app, deployment, [victim], 2)  # noqa: E731
        return time.monotonic(), self._served(PROBE_SIM, SIM_BACKEND), restored

    def _provider_stall(self) -> tuple[float, Callable[[], bool], Callable[[], bool] | None]:
        self.oai.push_faults(*["stall:3"] * self.scale.stalls)
        deadline = time.monotonic() + self.scale.recovery_timeout_s
        while self.oai._queue and time.monotonic() < deadline:  # taken by the next requests
            time.sleep(0.05)
        return time.monotonic(), self._served(PROBE_OPENAI, OPENAI_BACKEND), None

    def _window(self, server: Any, spec: str, shape: Shape, backend: str) -> tuple[float, Any, None]:
        server.default_fault = spec
        try:
            time.sleep(self.scale.window_s)
        finally:
            server.default_fault = None
        return time.monotonic(), self._served(shape, backend), None

    def _kill_gateway(self) -> tuple[float, Callable[[], bool], Callable[[], bool] | None]:
        ids = replica_ids(self.app, GATEWAY)
        self.gateway_replicas_at_kill = ids
        self.gateway_killed = ids[0]
        t_read = time.monotonic()
        self.counters_before_gateway_kill = gateway_counters(self.app)
        t_kill, t_gone = self._kill(GATEWAY, ids[0])
        self.gateway_kill_times = (t_read, t_kill, t_gone)
        restored = lambda: replaced(self.app, GATEWAY, ids[:1], GATEWAY_REPLICAS)  # noqa: E731
        return time.monotonic(), self._served(PROBE_OPENAI, None), restored

    def inject(self, name: str) -> tuple[float, Callable[[], bool], Callable[[], bool] | None]:
        if name == "kill_sim_replica":
            return self._kill_sim_replica()
        if name == "provider_stall":
            return self._provider_stall()
        if name == "provider_429":
            return self._window(self.oai, "429:1", PROBE_OPENAI, OPENAI_BACKEND)
        if name == "provider_500":
            return self._window(self.oai, "500", PROBE_OPENAI, OPENAI_BACKEND)
        if name == "anthropic_529":
            return self._window(self.ant, "529", PROBE_CLAUDE, ANTHROPIC_BACKEND)
        if name == "kill_gateway":
            return self._kill_gateway()
        raise ValueError(f"unknown fault {name!r}")

    # ------------------------------------------------------------------------------------------
    def _ready(self, name: str) -> None:
        """Before a kill (outside its measured window): the deployment whole again."""
        deployment, replicas = {
            "kill_gateway": (GATEWAY, GATEWAY_REPLICAS),
            "kill_sim_replica": (f"backend-{SIM_BACKEND}", 2),
        }.get(name, (None, 0))
        if deployment is not None and not self._whole(deployment, replicas):
            raise RuntimeError(f"{deployment} did not have its {replicas} replicas back in time")

    def run(self, name: str) -> dict[str, Any]:
        self._ready(name)
        t_inject = time.monotonic()
        in_flight = len(self.load.in_flight())
        t_end, normal, restored = self.inject(name)
        recovery = wait_until(normal, self.scale.recovery_timeout_s)
        t_recovered = time.monotonic()
        time.sleep(self.scale.settle_s)
        cohort = [
            r
            for r in self.load.snapshot()
            if r.t0 <= t_recovered and (r.t1 is None or r.t1 >= t_inject) and not r.shape.startswith("probe")
        ]
        deadline = time.monotonic() + 40  # they end by their deadlines (or count as hung)
        while any(not r.ended for r in cohort) and time.monotonic() < deadline:
            time.sleep(0.2)
        result = summarize(name, cohort, in_flight, t_end - t_inject, recovery, None)
        if name == "kill_gateway":
            result["kill"] = self._gateway_kill(cohort)
        if restored is not None:
            self._watch_restore(result, restored, t_end)
        return result

    def _gateway_kill(self, cohort: list[Record]) -> dict[str, Any]:
        """Which connections the kill may break: those the victim held. Its in-flight count was read
        just before the kill; requests sent from that read until its process was gone (``ray.kill``
        only asks: the process dies a moment later) may have gone to it too."""
        assert self.gateway_kill_times is not None and self.counters_before_gateway_kill is not None
        t_read, t_kill, t_gone = self.gateway_kill_times
        victim = self.counters_before_gateway_kill.get(self.gateway_killed or "", {})
        broken = [r for r in cohort if r.outcome == "conn_error"]
        gone = t_gone if t_gone is not None else float("inf")
        return {
            "replica": self.gateway_killed,
            "replicas_at_kill": list(self.gateway_replicas_at_kill),
            "victim_in_flight": victim.get("in_flight"),
            "victim_waiting": victim.get("waiting"),  # queued for admission: their connections too
            "process_gone_s": None if t_gone is None else round(t_gone - t_kill, 3),
            "sent_between_read_and_gone": sum(1 for r in cohort if t_read <= r.t0 <= gone),
            # sent before the read and not answered yet: maybe in a gateway's door (parsed, checked,
            # not admitted), which its in-flight and waiting counts do not include
            "unanswered_at_read": sum(1 for r in cohort if r.t0 < t_read and _unanswered(r, t_read)),
            "conn_error_answered_by_other": sum(
                1 for r in broken if r.gateway and r.gateway != self.gateway_killed
            ),
            "conn_error_unanswered": sum(1 for r in broken if r.t_headers is None),
            "conn_error_sent_after_gone": sum(1 for r in broken if r.t0 > gone),
            "conn_error_ended_before_kill": sum(1 for r in broken if r.t1 is not None and r.t1 < t_kill),
            # start_s: from the ray.kill call (< 0: sent before it)
            "conn_error_detail": [{**describe(r, t_kill), "error": r.error_text[:200]} for r in broken],
            "bad_error_shape_detail": [
                {**describe(r, t_kill), "error": r.error_text[:200]} for r in cohort if not r.shape_ok
            ],
        }

    def _watch_restore(self, result: dict[str, Any], restored: Callable[[], bool], t_end: float) -> None:
        """Fill ``result["restored_s"]`` in when Serve has the killed replica back (a thread)."""

        def watch() -> None:
            while time.monotonic() - t_end < RESTORE_TIMEOUT_S:
                try:
                    if restored():
                        result["restored_s"] = round(time.monotonic() - t_end, 2)
                        return
                except Exception:  # the controller is busy: try again
                    pass
                time.sleep(0.25)

        t = threading.Thread(target=watch, name=f"restore-{result['fault']}", daemon=True)
        t.start()
        self.watchers.append(t)

    def wait_restored(self, timeout: float = RESTORE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for t in self.watchers:
            t.join(max(0.0, deadline - time.monotonic()))


def summarize(
    name: str,
    cohort: list[Record],
    in_flight: int,
    fault_s: float,
    recovery_s: float | None,
    restored_s: float | None,
) -> dict[str, Any]:
    ends = Counter(r.outcome if r.ended else "hung" for r in cohort)
    out: dict[str, Any] = {
        "fault": name,
        "in_flight": in_flight,
        "cohort": len(cohort),
        **{k: ends.get(k, 0) for k in OUTCOMES},
    }
    out["errored"] = sum(ends.get(k, 0) for k in ERRORED)
    out["error_codes"] = dict(Counter(r.error_code or str(r.status) for r in cohort if r.outcome in ERRORED))
    out["bad_error_shape"] = sum(1 for r in cohort if not r.shape_ok)
    out["bad_error_shape_detail"] = [
        {**describe(r, cohort[0].t0), "error": r.error_text[:200]} for r in cohort if not r.shape_ok
    ]
    out["hung_detail"] = [
        describe(r, cohort[0].t0 if cohort else 0.0) for r in cohort if not r.ended or r.outcome == "hung"
    ]
    out["fault_s"] = round(fault_s, 2)
    out["recovery_s"] = None if recovery_s is None else round(recovery_s, 2)
    out["restored_s"] = None if restored_s is None else round(restored_s, 2)
    return out


SERVED = ("completed", "failed_over")


def _unanswered(r: Record, t: float) -> bool:
    """No response headers yet at ``t``, and not ended before it."""
    return (r.t_headers is None or r.t_headers > t) and (r.t1 is None or r.t1 >= t)


def describe(r: Record, t_ref: float) -> dict[str, Any]:
    """One request, for a report: what it was and how far it got."""
    return {
        "shape": r.shape,
        "surface": r.surface,
        "request_id": r.request_id,
        "status": r.status,
        "backend": r.backend,
        "gateway": r.gateway,
        "headers_s": None if r.t_headers is None else round(r.t_headers - t_ref, 2),
        "chunks": r.chunks,
        "start_s": round(r.t0 - t_ref, 2),
        "took_s": None if r.t1 is None else round(r.t1 - r.t0, 2),
    }


def provider_accounting(records: list[Record], oai: Any, ant: Any) -> dict[str, Any]:
    """Tokens the loopback providers counted vs the usage our clients were given.

    ``diff``: tokens of the requests a provider finished minus the usage our clients got for the
    requests that provider served (0 when every finished request was delivered with its usage).
    OpenAI requests are also matched one by one (our request id travels as ``x-client-request-id``):
    ``per_request_mismatches`` lists those whose usage differs, ``finished_not_delivered`` those the
    provider finished while our client got an error (billed, not served: e.g. the gateway killed
    mid-stream). ``billed_unfinished``: tokens counted for streams the provider did not finish
    (cancelled by the client, a lost hedge, a stall) - billed upstream, in no usage a client saw.
    ``unserved_requests`` (the requests for this provider's model whose client got no answer) times
    ``max_billed_per_request`` bounds ``diff`` from above: a finished request not delivered is one
    of those (Anthropic requests carry no id of ours, so they are not matched one by one).
    """
    ours = {r.request_id: r for r in records if r.request_id}
    out: dict[str, Any] = {}
    for label, server, backend in (("openai", oai, OPENAI_BACKEND), ("anthropic", ant, ANTHROPIC_BACKEND)):
        st = server.stats()
        ok = [x for x in st.records if x.outcome == "ok"]
        billed = sum(x.prompt_tokens + x.completion_tokens for x in ok)
        unfinished = [x for x in st.records if x.outcome != "ok"]
        mine = [r for r in records if r.backend == backend and r.outcome in SERVED]
        model = PROBE_CLAUDE.model if label == "anthropic" else PROBE_OPENAI.model
        used = sum((r.prompt_tokens or 0) + (r.completion_tokens or 0) for r in mine)
        entry: dict[str, Any] = {
            "provider_requests_ok": len(ok),
            "our_requests_served": len(mine),
            "billed_tokens": billed,
            "our_usage_tokens": used,
            "diff": billed - used,
            "served_without_usage": sum(1 for r in mine if r.completion_tokens is None),
            "billed_unfinished": sum(x.prompt_tokens + x.completion_tokens for x in unfinished),
            "unfinished_outcomes": dict(Counter(x.outcome for x in unfinished)),
            "unserved_requests": sum(1 for r in records if r.model == model and r.outcome not in SERVED),
            "max_billed_per_request": max((x.prompt_tokens + x.completion_tokens for x in ok), default=0),
        }
        if label == "openai":
            mismatched, not_delivered, unknown = [], [], []
            unknown_tokens = 0
            for x in ok:
                r = ours.get(x.client_request_id or "")
                if r is None:
                    unknown.append(x.client_request_id)
                    unknown_tokens += x.prompt_tokens + x.completion_tokens
                elif r.outcome not in SERVED or r.backend != backend:
                    not_delivered.append(
                        (x.client_request_id, r.outcome, x.prompt_tokens + x.completion_tokens)
                    )
                elif (r.prompt_tokens, r.completion_tokens) != (x.prompt_tokens, x.completion_tokens):
                    mismatched.append(x.client_request_id)
            entry["per_request_mismatches"] = mismatched
            entry["finished_not_delivered"] = not_delivered
            entry["finished_unknown"] = unknown
            # what the delivered requests were billed beyond their usage: 0 unless usage is wrong
            # (finished but not delivered, to a known or an unknown client, is billed, not served)
            entry["diff_delivered"] = entry["diff"] - sum(t for _, _, t in not_delivered) - unknown_tokens
        out[label] = entry
    return out


def run_faults(
    app: str,
    base_url: str,
    keys: Keys,
    oai: Any,
    ant: Any,
    scale: Scale = SHORT,
    faults: list[str] | None = None,
) -> dict[str, Any]:
    """The whole run; the providers' counters are reset first (nothing else may use them meanwhile)."""
    oai.reset()
    ant.reset()
    run = FaultRun(app, base_url, keys, oai, ant, scale)
    t0 = time.monotonic()
    results = []
    with run.load:
        time.sleep(scale.warmup_s)
        for name in faults or FAULTS:
            for _ in range(scale.repeats):
                results.append(run.run(name))
    records = run.load.snapshot()
    run.wait_restored()
    counters = wait_idle(app)
    everything = records + run.probes
    ends = Counter(r.outcome if r.ended else "hung" for r in records)
    return {
        "scale": scale.__dict__,
        "duration_s": round(time.monotonic() - t0, 1),
        "requests": len(records),
        "endings": dict(ends),
        "faults": results,
        "gateway_counters_before_kill": run.counters_before_gateway_kill,
        "gateway_killed": run.gateway_killed,
        "gateway_counters_end": counters,
        "policy": gateway_policies(app),  # per gateway replica: each runs its own breakers and hedges
        "accounting": provider_accounting(everything, oai, ant),
        "bad_error_shape": sum(1 for r in records if not r.shape_ok),
        "hung": [describe(r, t0) for r in records if not r.ended or r.outcome == "hung"],
        "_records": everything,
    }


def markdown(summary: dict[str, Any]) -> str:
    cols = ["fault", "in_flight", "cohort", *OUTCOMES, "recovery_s", "restored_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for f in summary["faults"]:
        lines.append("| " + " | ".join("-" if f.get(c) is None else str(f.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def public(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", action="store_true", help="longer windows, more load, 2 repeats")
    p.add_argument("--out", default=str(RESULTS / "faults.json"))
    p.add_argument("--markdown", action="store_true", help="print the Markdown table")
    args = p.parse_args(argv)

    git, load0, t0 = git_state(), os.getloadavg(), time.monotonic()
    with loopback_app("llmc-faults", "/faults") as app:
        summary = run_faults(
            app.cfg.name, app.base_url, app.keys, app.openai, app.anthropic, LONG if args.long else SHORT
        )
    out = public(summary)
    out["provenance"] = provenance(argv or sys.argv[1:], git, load0, t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({k: out[k] for k in ("duration_s", "requests", "endings", "accounting")}, indent=2))
    if args.markdown:
        print(markdown(summary))


if __name__ == "__main__":
    main()
