"""A bounded mixed load for the lab rehearsal (tests/integration/lab_rehearsal_check.py), run as a
process of its own in the lab's client namespace (``ip netns exec llmc-lab0-client python …``):
streaming chat completions from Tab, Chat and Agent clients (``x-surface``), spread over the
given Serve addresses, until a stop file appears (or ``--max-s``). Each request's outcome is one
record of the JSON it writes: times (``time.time()``, to set beside the test's events), status,
tokens, error events, whether the stream ended with a finish_reason and ``[DONE]``, the replica
(``x-llmc-replica``) and a client-side exception (a ``ReadTimeout`` is a hung request).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

SURFACES = {"tab": 12, "chat": 160, "agent": 240}  # max_tokens: streams long enough to be cut


def one(client: httpx.Client, url: str, surface: str, n: int) -> dict[str, Any]:
    body = {
        "model": "sim-llama-8b",
        "stream": True,
        "max_tokens": SURFACES[surface],
        "messages": [{"role": "user", "content": f"{surface} request {n}: tell me about the cluster"}],
    }
    rec: dict[str, Any] = {"surface": surface, "url": url, "t0": time.time(), "t_first": None}
    rec |= {"status": None, "tokens": 0, "errors": [], "finish": None, "done": False, "replica": None}
    try:
        with client.stream("POST", url, json=body, headers={"x-surface": surface}) as r:
            rec["status"], rec["replica"] = r.status_code, r.headers.get("x-llmc-replica")
            if r.status_code != 200:
                rec["errors"].append(r.read().decode(errors="replace")[:300])
            for line in r.iter_lines() if r.status_code == 200 else ():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec["done"] = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["errors"].append(event["error"])
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        rec["tokens"] += 1
                        rec["t_first"] = rec["t_first"] or time.time()
                    rec["finish"] = choice.get("finish_reason") or rec["finish"]
    except httpx.HTTPError as exc:
        rec["exception"] = f"{type(exc).__name__}: {exc}"
    rec["t_end"] = time.time()
    return rec


def worker(
    urls: list[str], surface: str, k: int, stop: Path, until: float, out: list[dict[str, Any]]
) -> None:
    timeout = httpx.Timeout(30.0, connect=5.0)
    with httpx.Client(timeout=timeout) as client:
        for n in itertools.count():
            if stop.exists() or time.time() > until:
                return
            out.append(one(client, urls[(n + k) % len(urls)], surface, n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", action="append", required=True, help="a Serve node's chat completions URL")
    ap.add_argument("--per-surface", type=int, default=2, help="concurrent clients per surface")
    ap.add_argument("--stop", type=Path, required=True, help="the load ends once this file exists")
    ap.add_argument("--max-s", type=float, default=300.0, help="the load ends after this anyway")
    ap.add_argument("--out", type=Path, required=True, help="the JSON of every request's outcome")
    args = ap.parse_args()
    until = time.time() + args.max_s
    records: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=worker, args=(args.url, s, k, args.stop, until, records))
        for s in SURFACES
        for k in range(args.per_surface)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
