"""Arrival processes for open-loop load: when each request is sent, as offsets in seconds from t=0.

Pure and seeded: the same arguments give the same times on every machine, so a benchmark is
repeatable and two configurations can be driven by exactly the same schedule.

* :func:`poisson` — exponential gaps (memoryless traffic, coefficient of variation 1).
* :func:`gamma_bursty` — gamma gaps with a chosen coefficient of variation ``cv``: ``cv > 1`` is
  bursty (clumps of requests, then lulls), ``cv < 1`` is smoother than Poisson, ``cv = 1`` is
  Poisson. Shape ``k = 1/cv²``, scale ``1/(rate·k)``, so the mean rate stays ``rate``.
* Trace replay: :func:`write_trace` / :func:`read_trace` store one JSON object per line, each with
  an arrival offset ``t`` and whatever describes the request (surface, session, prompt, …).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

KINDS = ("poisson", "gamma", "uniform")


def _rng(seed: int | random.Random | None) -> random.Random:
    return seed if isinstance(seed, random.Random) else random.Random(seed)


def _times(gap: Any, duration_s: float | None, n: int | None, start_s: float = 0.0) -> list[float]:
    if duration_s is None and n is None:
        raise ValueError("give duration_s or n (or both)")
    if duration_s is not None and duration_s < 0:
        raise ValueError("duration_s must be >= 0")
    if n is not None and n < 0:
        raise ValueError("n must be >= 0")
    out: list[float] = []
    t = start_s
    while n is None or len(out) < n:
        t += gap()
        if duration_s is not None and t - start_s >= duration_s:
            break
        out.append(t)
    return out


def poisson(
    rate: float,
    *,
    duration_s: float | None = None,
    n: int | None = None,
    seed: int | random.Random | None = 0,
    start_s: float = 0.0,
) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate`` per second, until ``duration_s`` or ``n``
    (counted from ``start_s``, where the process starts)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = _rng(seed)
    return _times(lambda: rng.expovariate(rate), duration_s, n, start_s)


def gamma_bursty(
    rate: float,
    cv: float = 2.0,
    *,
    duration_s: float | None = None,
    n: int | None = None,
    seed: int | random.Random | None = 0,
) -> list[float]:
    """Arrival offsets with gamma-distributed gaps: mean rate ``rate``, gap CV ``cv`` (> 1 = bursty)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if cv <= 0:
        raise ValueError("cv must be > 0")
    rng = _rng(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return _times(lambda: rng.gammavariate(shape, scale), duration_s, n)


def uniform(rate: float, *, duration_s: float | None = None, n: int | None = None) -> list[float]:
    """Evenly spaced arrivals (a constant-rate baseline): 1/rate, 2/rate, …"""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    return _times(lambda: 1.0 / rate, duration_s, n)


def arrivals(
    kind: str,
    rate: float,
    *,
    duration_s: float | None = None,
    n: int | None = None,
    cv: float = 2.0,
    seed: int | random.Random | None = 0,
) -> list[float]:
    """One entry point for the CLI: ``kind`` is poisson, gamma (bursty, ``cv``) or uniform."""
    if kind == "poisson":
        return poisson(rate, duration_s=duration_s, n=n, seed=seed)
    if kind == "gamma":
        return gamma_bursty(rate, cv, duration_s=duration_s, n=n, seed=seed)
    if kind == "uniform":
        return uniform(rate, duration_s=duration_s, n=n)
    raise ValueError(f"unknown arrival process '{kind}' (known: {', '.join(KINDS)})")


def gap_stats(times: list[float]) -> dict[str, float]:
    """Mean rate and the coefficient of variation of the gaps (a check on a schedule or a trace)."""
    if len(times) < 2:
        return {"n": len(times), "rate": 0.0, "cv": 0.0}
    gaps = [b - a for a, b in zip([0.0, *times[:-1]], times, strict=True)]
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return {"n": len(times), "rate": 1.0 / mean if mean > 0 else math.inf, "cv": math.sqrt(var) / mean}


# --- trace replay ---------------------------------------------------------------------------------


def write_trace(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> int:
    """Write records (dicts with an arrival offset ``t`` in seconds) as JSONL, sorted by ``t``.

    Returns the number written. Keys are sorted so the same trace is byte-identical across runs.
    """
    rows = sorted(records, key=lambda r: float(r["t"]))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n")
    return len(rows)


def iter_trace(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Records of a JSONL trace in file order; blank lines and ``#`` comments are skipped.

    A line without a numeric ``t`` >= 0 raises ValueError naming the line.
    """
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                rec = json.loads(s)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            t = rec.get("t") if isinstance(rec, dict) else None
            if not isinstance(t, int | float) or isinstance(t, bool) or t < 0:
                raise ValueError(f"{path}:{lineno}: every record needs a number 't' >= 0 (seconds)")
            yield rec


def read_trace(
    path: str | os.PathLike[str], *, time_scale: float = 1.0, limit: int | None = None
) -> list[dict[str, Any]]:
    """A trace's records sorted by ``t``; ``time_scale`` < 1 replays it faster (0.5 = twice the rate)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    rows = sorted(iter_trace(path), key=lambda r: float(r["t"]))
    if limit is not None:
        rows = rows[:limit]
    if time_scale != 1.0:
        rows = [{**r, "t": float(r["t"]) * time_scale} for r in rows]
    return rows
