"""The node-loss event's own long streams (issue 41, ``loadtest/benchmarks/rehearsal.py``): the Locust users'
self-hosted streams are Agent's, one user in ten and a few seconds long, so a kill at a fixed time
found none of them on the lost node (the first full run: 0 in flight). The event therefore sends
``n`` long self-hosted streams of its own from the client namespace, waits until every one has
tokens, and kills the engine node that holds most of them; each stream is counted exactly.

Each stream is an Agent request with ``ignore_eos`` (only engines honour it: the gateway narrows it
to the self-hosted candidates) and a seed (the simulated engine's sampler is then deterministic),
read with the operator's debug header so that its token ids come along (``: ids`` lines). The same
streams run once before the kill as the reference: a stream that migrated is *identical* when its
token ids are the reference's, one for one (nothing duplicated, nothing missing at the seam).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

RETRIES_429 = 20  # a client's retries of a deferred request, each after its Retry-After (at most 5 s)
Runner = Callable[[Callable[[], Any], float], Any]  # fn run where the clients are, with a timeout


@dataclass
class Seen:
    """One stream as its client saw it."""

    replica: str | None = None
    ids: list[int] = field(default_factory=list)
    done: bool = False
    finish: str | None = None
    error: Any = None
    usage: dict[str, Any] | None = None
    t0: float = 0.0
    t_end: float | None = None

    def completed(self, max_tokens: int) -> bool:
        """Ended with ``[DONE]``, a finish reason, no error event and every token asked for."""
        n = (self.usage or {}).get("completion_tokens")
        return self.done and self.error is None and self.finish is not None and n == max_tokens


def body(model: str, i: int, max_tokens: int, seed: int) -> dict[str, Any]:
    prompt = f"long stream {i} (seed {seed}): walk me through the repository, file by file"
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed + i,
        "messages": [{"role": "user", "content": prompt}],
    }


def _line(seen: Seen, line: str) -> None:
    if line.startswith(": ids "):
        seen.ids += [int(t) for t in line[6:].split(",") if t]
    elif line == "data: [DONE]":
        seen.done = True
    elif line.startswith("data: {"):
        ev = json.loads(line[6:])
        if ev.get("error") is not None:
            seen.error = ev["error"]
        seen.usage = ev.get("usage") or seen.usage
        for choice in ev.get("choices") or []:
            seen.finish = choice.get("finish_reason") or seen.finish


def read(url: str, payload: dict[str, Any], token: str, seen: Seen, read_s: float) -> None:
    """One stream to its end (a read that waits ``read_s`` for the next bytes is a hung stream)."""
    import httpx

    headers = {"x-surface": "agent", "x-llmc-internal": token, "x-llmc-debug-ids": "1"}
    try:
        with httpx.Client(timeout=httpx.Timeout(read_s, connect=5.0)) as c:
            for _ in range(RETRIES_429):  # Agent is deferred (429) while Tab nears its objective
                seen.t0, seen.error = time.time(), None
                with c.stream("POST", url, json=payload, headers=headers) as r:
                    seen.replica = r.headers.get("x-llmc-replica")
                    if r.status_code != 200:
                        seen.error = f"http_{r.status_code}: {r.read()[:200]!r}"
                        if r.status_code != 429:
                            return
                        time.sleep(min(float(r.headers.get("retry-after") or 1), 5.0))
                        continue
                    for line in r.iter_lines():
                        _line(seen, line)
                    return
    except httpx.TimeoutException as exc:
        seen.error = f"hung: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    finally:
        seen.t_end = time.time()


class LongStreams:
    """``n`` streams at once, spread over the Serve addresses ``urls``, each in a thread of its own
    run through ``runner`` (the lab's client namespace)."""

    def __init__(self, runner: Runner, urls: list[str], token: str, model: str, **kw: Any) -> None:
        self.runner, self.urls, self.token, self.model = runner, urls, token, model
        self.n: int = kw.get("n", 8)
        self.max_tokens: int = kw.get("max_tokens", 1200)
        self.seed: int = kw.get("seed", 4100)
        self.read_s: float = kw.get("read_s", 30.0)
        self.seen = [Seen() for _ in range(self.n)]
        self._threads: list[threading.Thread] = []

    def start(self) -> LongStreams:
        for i, s in enumerate(self.seen):
            url = self.urls[i % len(self.urls)] + "/v1/chat/completions"
            payload = body(self.model, i, self.max_tokens, self.seed)

            def one(url: str = url, payload: dict[str, Any] = payload, s: Seen = s) -> None:
                self.runner(lambda: read(url, payload, self.token, s, self.read_s), 600.0)

            t = threading.Thread(target=one, name=f"long-stream-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def wait_on_node(self, node_of: dict[str, str], k: int, tokens: int, timeout_s: float) -> str | None:
        """The first node with ``k`` streams in flight there, each with ``tokens`` token ids (the
        SLO guard lets Agent streams in a few at a time while Tab is near its objective); None
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [s for s in self.seen if s.t_end is None and not s.done and len(s.ids) >= tokens]
            node = busiest_node(live, node_of)
            if node is not None and sum(node_of.get(s.replica or "") == node for s in live) >= k:
                return node
            time.sleep(0.05)
        return None

    def join(self, timeout_s: float) -> list[Seen]:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.seen

    def run(self, timeout_s: float) -> list[Seen]:
        return self.start().join(timeout_s)


def busiest_node(seen: Iterable[Seen], node_of: dict[str, str]) -> str | None:
    """The node whose replicas hold the most of the streams."""
    counts: dict[str, int] = {}
    for s in seen:
        node = node_of.get(s.replica or "")
        if node is not None:
            counts[node] = counts.get(node, 0) + 1
    return max(sorted(counts), key=counts.__getitem__) if counts else None


def tally(
    seen: list[Seen], reference: list[Seen], lost: Iterable[str], kill: float, max_tokens: int
) -> dict[str, Any]:
    """The streams in flight on the lost replicas at ``kill``: how many, how many completed on
    another replica, how many got every token once (by the ids at the client), how many are token
    for token the reference's, how many hung; the rest too."""
    lost_set = set(lost)
    pairs = list(zip(seen, reference, strict=True))

    def on_lost(s: Seen) -> bool:
        return s.replica in lost_set and s.t0 < kill and (s.t_end is None or s.t_end > kill)

    hit = [(s, r) for s, r in pairs if on_lost(s)]
    others = [s for s, _ in pairs if not on_lost(s)]
    return {
        "sent": len(seen),
        "max_tokens": max_tokens,
        "reference_completed": sum(r.completed(max_tokens) for r in reference),
        "in_flight_on_lost": len(hit),
        "completed": sum(s.completed(max_tokens) for s, _ in hit),
        "identical_to_reference": sum(s.completed(max_tokens) and s.ids == r.ids for s, r in hit),
        # the client got exactly the tokens asked for, one id each: none twice, none lost at the seam
        "every_token_once": sum(s.completed(max_tokens) and len(s.ids) == max_tokens for s, _ in hit),
        "hung": sum(s.t_end is None or str(s.error).startswith("hung") for s, _ in hit),
        "errors": [str(s.error)[:200] for s, _ in hit if s.error is not None],
        "others": len(others),
        "others_completed": sum(s.completed(max_tokens) for s in others),
        "other_errors": [str(s.error)[:200] for s in others if s.error is not None][:3],
        "reference_errors": [str(r.error)[:200] for r in reference if r.error is not None][:3],
    }
