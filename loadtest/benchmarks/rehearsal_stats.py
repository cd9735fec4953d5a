"""The rehearsal's accounting (``loadtest/benchmarks/rehearsal.py``), pure: the Locust users' per-request
records (``loadtest/benchmarks/rehearsal_users.py``) and the schedule's event times in, per-event figures and
the issue's flat result keys out.

A record's outcome is one of: ``completed``; ``cancelled`` (the client gave up on purpose: Tab's
cancels); ``failed_before_first_token`` (an error status or transport error with no token, by its
``error`` code); ``mid_stream_error`` (an error event after tokens); ``cut`` (the connection ended
after tokens without an error event); ``hung`` (the client's read timeout); ``refused_400`` (the
request's own fault, e.g. an Agent conversation grown past the context window: not a failure of
the cluster, counted apart).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Record = Mapping[str, Any]
OK = ("completed", "cancelled", "refused_400")
HIT_RATE_POINTS = 0.05  # "back within 5 points of steady state"
HIT_BIN_S = 10.0  # the window a hit rate is measured over while it recovers
MIN_BIN_REQUESTS = 3
MAX_LISTED = 50  # failed requests listed one by one per summary (all are counted)


def outcome(rec: Record) -> str:
    err = rec.get("error")
    if err == "timeout":
        return "hung"
    if err is None:
        return "cancelled" if rec.get("cancelled") else "completed"
    if str(err).startswith("http_400:"):
        return "refused_400"
    if rec.get("ttft_s") is None:
        return "failed_before_first_token"
    return "mid_stream_error" if str(err).startswith("stream:") else "cut"


def failed(rec: Record) -> bool:
    return outcome(rec) not in OK


def why(rec: Record) -> dict[str, Any]:
    """A failed request as the result lists it: when, where, and what the client was told (the
    error object's code, type and message, or the transport exception)."""
    return {
        "t0": round(float(rec["t0"]), 3),
        "ms": round(1000 * (float(rec["t_end"]) - float(rec["t0"])), 1),
        "surface": rec.get("surface"),
        "outcome": outcome(rec),
        "error": rec.get("error"),
        **(rec.get("error_detail") or {}),
        "url": rec.get("url"),
        "backend": rec.get("backend"),
        "replica": rec.get("replica"),
    }


def overlapping(records: Iterable[Record], t0: float, t1: float) -> list[Record]:
    """The requests in flight at some time in [t0, t1]."""
    return [r for r in records if r["t0"] <= t1 and r["t_end"] >= t0]


def started(records: Iterable[Record], t0: float, t1: float) -> list[Record]:
    return [r for r in records if t0 <= r["t0"] < t1]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank, as the locustfile's summary takes it."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else None


def hit_rate(records: Iterable[Record], backend: str | None = None) -> float | None:
    """Cached prompt tokens / prompt tokens over the requests that reported usage (of ``backend``)."""
    prompt = cached = 0
    for r in records:
        if r.get("prompt_tokens") and (backend is None or r.get("backend") == backend):
            prompt += int(r["prompt_tokens"])
            cached += int(r.get("cached_tokens") or 0)
    return round(cached / prompt, 4) if prompt else None


def summary(records: Sequence[Record], backend: str | None = None) -> dict[str, Any]:
    """Requests by outcome, failures before the first token by code, TTFT p50/p99 per surface (ms),
    the self-hosted prefix-cache hit rate."""
    ttft: dict[str, list[float]] = {}
    for r in records:
        if r.get("ttft_s") is not None:
            ttft.setdefault(r["surface"], []).append(1000 * r["ttft_s"])
    return {
        "requests": len(records),
        "outcomes": dict(Counter(outcome(r) for r in records)),
        "failed_before_first_token_by_code": dict(
            Counter(str(r["error"]) for r in records if outcome(r) == "failed_before_first_token")
        ),
        "ttft_ms": {
            s: {"n": len(v), "p50": _ms(percentile(v, 0.5)), "p99": _ms(percentile(v, 0.99))}
            for s, v in sorted(ttft.items())
        },
        "hit_rate": hit_rate(records, backend),
        "failures": [why(r) for r in records if failed(r)][:MAX_LISTED],
        "slowest": {s: slowest(records, s) for s in sorted(ttft)},
    }


def slowest(records: Iterable[Record], surface: str) -> dict[str, Any]:
    """The request of ``surface`` with the slowest first token (a small window's p99): when, where,
    and the race that got it there."""
    r = max(
        (r for r in records if r["surface"] == surface and r.get("ttft_s") is not None),
        key=lambda r: r["ttft_s"],
    )
    keys = ("url", "gateway", "backend", "replica", "attempts", "hedge_won", "timing")
    return {"t0": round(float(r["t0"]), 3), "ttft_ms": _ms(1000 * r["ttft_s"]), **{k: r.get(k) for k in keys}}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def recovery_s(
    records: Sequence[Record], since: float, until: float, steady: float | None, backend: str | None = None
) -> float | None:
    """Seconds from ``since`` until the hit rate of the requests started in the last ``HIT_BIN_S``
    is back within ``HIT_RATE_POINTS`` of ``steady`` (None: not before ``until``)."""
    if steady is None:
        return None
    t = since + HIT_BIN_S
    while t <= until:
        window = [r for r in started(records, t - HIT_BIN_S, t) if r.get("prompt_tokens")]
        rate = hit_rate(window, backend)
        if len(window) >= MIN_BIN_REQUESTS and rate is not None and rate >= steady - HIT_RATE_POINTS:
            return round(t - since, 1)
        t += 1.0
    return None


def event_report(
    records: Sequence[Record], ev: Mapping[str, Any], backend: str | None = None
) -> dict[str, Any]:
    """One event against the steady state before it: ``ev`` holds ``steady`` [t0, t1], ``during``
    [t0, t1] (from the fault until the lab is back at full strength) and ``after`` [t0, t1]."""
    out: dict[str, Any] = {}
    for phase in ("steady", "during", "after"):
        t0, t1 = ev[phase]
        pick = overlapping if phase == "during" else started
        out[phase] = summary(pick(records, t0, t1), backend)
    return out


def ratio(during: float | None, steady: float | None) -> float | None:
    return round(during / steady, 2) if during is not None and steady else None


def in_flight_on(records: Iterable[Record], at: float, replicas: Iterable[str]) -> list[Record]:
    """The streams that had started on one of ``replicas`` and not ended at ``at``."""
    lost = set(replicas)
    return [r for r in records if r["t0"] < at < r["t_end"] and r.get("replica") in lost]


def _window(ev: Mapping[str, Any], phase: str) -> tuple[float, float]:
    t0, t1 = ev[phase]
    return float(t0), float(t1)


def _on_lost_pod(r: Record, ev: Mapping[str, Any]) -> bool:
    """Sent to the lost pod's own Serve address and still open when it was killed."""
    return bool(ev.get("lost_url")) and r.get("url") == ev["lost_url"] and r["t0"] < ev["kill"] < r["t_end"]


def _count(records: Iterable[Record], *names: str) -> int:
    return sum(1 for r in records if outcome(r) in names)


def _p99(records: Iterable[Record], surface: str) -> float | None:
    return percentile(
        [1000 * r["ttft_s"] for r in records if r["surface"] == surface and r.get("ttft_s")], 0.99
    )


def flat_keys(
    records: Sequence[Record], events: Mapping[str, Mapping[str, Any]], backend: str
) -> dict[str, Any]:
    """The issue's flat result keys from the records and the events that ran (None: not run)."""
    out: dict[str, Any] = dict.fromkeys(FLAT_KEYS)
    if ev := events.get("upgrade"):
        out["upgrade_failed"] = sum(failed(r) for r in overlapping(records, *_window(ev, "during")))
    if ev := events.get("node_loss"):
        window = overlapping(records, *_window(ev, "during"))
        # a client connected to the lost pod's own HAProxy loses that connection with the pod (no
        # server can carry it elsewhere): counted apart, as the gateway loss counts its own
        on_pod = [r for r in window if _on_lost_pod(r, ev)]
        out["node_loss_cut_on_lost_pod"] = sum(failed(r) for r in on_pod)
        window = [r for r in window if not _on_lost_pod(r, ev)]
        out["node_loss_failed_before_first_token"] = _count(window, "failed_before_first_token")
        out["node_loss_hung"] = _count(window, "hung")
        if "kill" in ev:
            on_lost = in_flight_on(records, ev["kill"], ev.get("lost_replicas", ()))
            on_lost = [r for r in on_lost if not _on_lost_pod(r, ev)]  # their connection died too
            own = ev.get("long_streams") or {}  # the event's own long streams (rehearsal_streams)
            out["node_loss_streams_in_flight"] = len(on_lost) + own.get("in_flight_on_lost", 0)
            out["node_loss_streams_completed"] = _count(on_lost, "completed") + own.get("completed", 0)
            out["node_loss_streams_identical"] = own.get("identical_to_reference")
            out["node_loss_streams_every_token_once"] = own.get("every_token_once")
            out["node_loss_hung"] += own.get("hung", 0)
        if "rejoined" in ev:
            steady = hit_rate(started(records, *_window(ev, "steady")), backend)
            out["hit_rate_recovery_s"] = recovery_s(
                records, ev["rejoined"], _window(ev, "after")[1], steady, backend
            )
    gateway = [ev for name, ev in events.items() if name in ("gateway_replica", "cpu_node") and "kill" in ev]
    if gateway:
        new = [r for ev in gateway for r in started(records, ev["kill"] + 2.0, _window(ev, "after")[1])]
        out["gateway_loss_new_failures_after_2s"] = sum(failed(r) for r in new)
    if ev := events.get("provider_brownout"):
        during, steady = started(records, *_window(ev, "during")), started(records, *_window(ev, "steady"))
        for surface in ("tab", "chat"):  # the goal names both
            out[f"brownout_{surface}_p99_ratio"] = ratio(_p99(during, surface), _p99(steady, surface))
    if ev := events.get("kv_feed_cut"):
        out["kv_feed_cut_failed"] = sum(failed(r) for r in overlapping(records, *_window(ev, "during")))
        steady = hit_rate(started(records, *_window(ev, "steady")), backend)
        during = hit_rate(started(records, *_window(ev, "during")), backend)
        dip = None if steady is None or during is None else round(100 * (during - steady), 1)
        out["kv_feed_cut_hit_rate_points"] = dip
        out["kv_feed_cut_catch_up_s"] = None if ev.get("catch_up_s") is None else round(ev["catch_up_s"], 1)
    if ev := events.get("provider_outage"):
        out["outage_client_failures"] = sum(failed(r) for r in overlapping(records, *_window(ev, "during")))
    return out


FLAT_KEYS = (
    "upgrade_failed",
    "node_loss_failed_before_first_token",
    "node_loss_streams_in_flight",
    "node_loss_streams_completed",
    "node_loss_streams_identical",
    "node_loss_streams_every_token_once",
    "node_loss_hung",
    "node_loss_cut_on_lost_pod",
    "gateway_loss_new_failures_after_2s",
    "brownout_tab_p99_ratio",
    "brownout_chat_p99_ratio",
    "outage_client_failures",
    "hit_rate_recovery_s",
    "kv_feed_cut_failed",
    "kv_feed_cut_hit_rate_points",
    "kv_feed_cut_catch_up_s",
)
