"""The ``Server-Timing`` header (W3C Server Timing) on every completion the gateway answers: where
its time to the first token went, so that a client, a load test or an SRE reading one slow request
can tell the gateway's share from the backend's without the cluster's metrics.

    server-timing: prep;dur=0.152, queue;dur=0.000, upstream;dur=0.655, ttft;dur=1.102

All in milliseconds, each from the gateway's own clocks (it leaves with the response headers, which
a stream sends with its first token):

* ``prep``: from the request's arrival in the gateway's handler to its prepared request (the caller
  checked, the body read, parsed, validated and tokenized, the context fitted, the routes chosen);
* ``queue``: its wait in admission (0 when admitted at once);
* ``upstream``: from the winning attempt's start to its first item (a provider's or an engine's time
  to the first token, seen from the gateway: connection, its queue, prefill);
* ``ttft``: from arrival to the first token in the gateway. ``ttft`` minus the other three is the
  gateway's own work and waits besides (routing, the race, failed or hedged attempts before the winner).

Time before the handler (the HTTP server, Serve's replica wrapper, HAProxy) and after it (the write
to the client) is not in it: the client's own TTFT minus ``ttft`` is that.
"""

from __future__ import annotations

import contextlib

NAMES = ("prep", "queue", "upstream", "ttft")


def server_timing(prep_s: float, queue_s: float, upstream_s: float, ttft_s: float) -> str:
    """The header's value; seconds in, milliseconds out (a negative clock difference is shown as 0)."""
    parts = zip(NAMES, (prep_s, queue_s, upstream_s, ttft_s), strict=True)
    return ", ".join(f"{name};dur={max(0.0, s) * 1000:.3f}" for name, s in parts)


def parse_server_timing(value: str | None) -> dict[str, float]:
    """``{name: dur in ms}`` from a ``Server-Timing`` value (any server's: metrics without a ``dur``,
    or with one that is not a number, are left out)."""
    out: dict[str, float] = {}
    for metric in (value or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, val = param.partition("=")
            if key.strip().lower() == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(val.strip().strip('"'))
    return out
