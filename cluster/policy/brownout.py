"""Brownout demotion: a backend whose recent time to first token is far above its own steady state
goes behind a request's other candidates, so that new requests prefer them (the self-hosted
candidate behind a provider that slowed down) until it is fast again.

Hedging races a second backend for a slow first token, but within its budget (5 % of requests):
when every answer of a backend is slow (a brownout), the budget is gone within a few requests and
the rest wait the slow backend out; failover acts on errors only. The rehearsal's brownout (a
provider's TTFT x10 for 60 s) put Tab's p99 TTFT at 9x its steady state that way.

Per (surface, backend) a baseline: the median of the last ``baseline_samples`` first tokens that
were not slow; a surface with fewer than ``min_baseline`` of its own on a backend is judged against
the backend's first tokens of every surface (a surface that rarely reaches a backend, the one its
route sends elsewhere first, would else never be judged there: its probe's slow answer restored the
backend, and its requests never raced). A first token is *slow* when its TTFT is at least
``slow_factor`` x the baseline and ``min_excess_s`` above it; an attempt given up before its first
token (it lost a hedge race, the client left) counts as slow when it had waited ``given_up_factor``
x the baseline, and so does a hedge that won against it (a hedge starts past the primary's own high
TTFT quantile: in steady state a rare tail, in a brownout every hedged request, so the hedged
requests, not the unhedged ones, reveal it). At least ``slow_samples`` slow ones among its last
``recent_samples`` first tokens judged within ``window_s``, and at least ``slow_share`` of them (a
brownout slows every answer; a tail of slow ones is the hedge's to race), demote the backend for
``hold_s``, doubled for each demotion that follows within ``forget_s`` of the last (up to
``max_hold_s``). When the hold is over the backend is on probation: one request at a time keeps it
in its place (a probe); the probe's fast first token restores it, a slow one demotes it again.

Demoted backends go after the others, each list in its own order; when every candidate is demoted
the order stands. Pure: the clock (``now``, monotonic seconds) is passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import Field

from cluster.base import Strict

K = TypeVar("K")


class BrownoutConfig(Strict):
    enabled: bool = Field(True, description="Demote a backend whose recent TTFT is far above its own usual.")
    slow_factor: float = Field(3.0, gt=1, description="A first token this many times the baseline is slow.")
    min_excess_s: float = Field(
        0.2, ge=0, description="...and at least this much above it (a fast backend's jitter is no brownout)."
    )
    baseline_samples: int = Field(
        64, gt=0, description="Recent first tokens, not slow, whose median is the baseline."
    )
    min_baseline: int = Field(
        10, gt=0, description="Samples needed before a backend's TTFT is judged at all."
    )
    given_up_factor: float = Field(
        1.3,
        gt=1,
        description="An attempt given up before its first token after this x the baseline was slow.",
    )
    slow_samples: int = Field(
        2, gt=0, description="Fewest slow first tokens among the recent ones that demote."
    )
    slow_share: float = Field(
        0.5, gt=0, le=1, description="...when at least this share of its recent first tokens was slow."
    )
    recent_samples: int = Field(6, gt=0, description="The last first tokens judged for a demotion.")
    window_s: float = Field(10.0, gt=0, description="Judged first tokens older than this are forgotten.")
    hold_s: float = Field(5.0, gt=0, description="How long a first demotion lasts.")
    max_hold_s: float = Field(
        60.0, gt=0, description="Longest demotion (it doubles while the brownout lasts)."
    )
    forget_s: float = Field(
        120.0, gt=0, description="A demotion this long after the last one starts at hold_s again."
    )
    probe_timeout_s: float = Field(
        10.0, gt=0, description="A probe with no verdict by then lets the next one go."
    )
    recheck_s: float = Field(
        0.1,
        gt=0,
        description=(
            "A request past its hedge delay that the hedge budget refused looks this often whether "
            "its backend has been demoted meanwhile; then it races the next candidate outside the budget."
        ),
    )


def _push(samples: dict[K, deque[float]], key: K, value: float, keep: int) -> None:
    """Append ``value`` to ``samples[key]``, which keeps the last ``keep``."""
    d = samples.get(key)
    if d is None:
        d = samples[key] = deque(maxlen=keep)
    d.append(value)


@dataclass(slots=True)
class _State:
    recent: deque[tuple[float, bool]] = field(default_factory=deque)  # (time, slow), the last judged
    until: float | None = None  # demoted until then; on probation after it; None: in good standing
    hold_s: float = 0.0
    demoted_at: float = float("-inf")
    probe_at: float | None = None  # a probe request is out since then
    demotions: int = 0


class Brownout:
    def __init__(self, cfg: BrownoutConfig | None = None) -> None:
        self.cfg = cfg or BrownoutConfig()
        self._baseline: dict[tuple[str, str], deque[float]] = {}
        self._pooled: dict[str, deque[float]] = {}  # per backend, every surface's: the fallback
        self._states: dict[str, _State] = {}

    def baseline(self, surface: str, backend: str) -> float | None:
        """The median of the recent first tokens that were not slow, the surface's own or, with too
        few of them, the backend's on every surface (None: too few of those too)."""
        n = self.cfg.min_baseline
        b = self._baseline.get((surface, backend))
        if b is None or len(b) < n:
            b = self._pooled.get(backend)
        return statistics.median(b) if b is not None and len(b) >= n else None

    def observe(self, surface: str, backend: str, ttft_s: float, now: float, complete: bool = True) -> None:
        """An attempt's first token after ``ttft_s``; ``complete`` False: it was given up after
        waiting ``ttft_s`` (a lower bound, evidence only when already slow)."""
        base = self.baseline(surface, backend)
        cfg = self.cfg
        if base is None:
            slow = False
        elif complete:
            slow = ttft_s >= self._slow_from(base)
        else:
            slow = ttft_s >= cfg.given_up_factor * base
        st = self._state(backend)
        if slow or (complete and base is not None):
            st.recent.append((now, slow))
        if slow:
            self._slow(st, now)
        elif complete:
            _push(self._baseline, (surface, backend), ttft_s, cfg.baseline_samples)
            _push(self._pooled, backend, ttft_s, cfg.baseline_samples)
            if st.until is not None and now >= st.until:  # on probation: a fast answer restores it
                st.until, st.probe_at = None, None

    def _state(self, backend: str) -> _State:
        """``backend``'s state, made on first sight only (``setdefault`` would build a deque for
        every first token)."""
        st = self._states.get(backend)
        if st is None:
            st = self._states[backend] = _State(deque(maxlen=self.cfg.recent_samples))
        return st

    def hedge_won(self, surface: str, backend: str, now: float) -> None:
        """A hedge answered first while ``backend``, the request's primary, was still waiting past
        its hedge delay (its own high TTFT quantile): slow evidence, once it has a baseline."""
        if self.baseline(surface, backend) is not None:
            st = self._state(backend)
            st.recent.append((now, True))
            self._slow(st, now)

    def _slow(self, st: _State, now: float) -> None:
        cfg = self.cfg
        while st.recent and st.recent[0][0] <= now - cfg.window_s:
            st.recent.popleft()
        slow = sum(s for _, s in st.recent)
        probation = st.until is not None and now >= st.until
        if st.until is not None and not probation:
            return  # demoted already
        if probation or (slow >= cfg.slow_samples and slow >= cfg.slow_share * len(st.recent)):
            again = now - st.demoted_at < cfg.forget_s
            st.hold_s = min(2 * st.hold_s, cfg.max_hold_s) if again else cfg.hold_s
            st.until, st.demoted_at, st.probe_at = now + st.hold_s, now, None
            st.demotions += 1
            st.recent.clear()

    def demoted(self, backend: str, now: float) -> bool:
        """Whether ``backend`` goes behind the others now (on probation: unless a probe may go)."""
        st = self._states.get(backend)
        if not self.cfg.enabled or st is None or st.until is None:
            return False
        if now < st.until:
            return True
        return st.probe_at is not None and now - st.probe_at < self.cfg.probe_timeout_s

    def probe_hedge_delay(self, surface: str, backend: str) -> float | None:
        """When a request that is ``backend``'s probe (:meth:`order` gave it one) should race the
        next candidate: once its first token would be slow (None: not a probe, or no baseline). A
        probe of a backend still browned out then costs its client that delay, not the brownout."""
        st = self._states.get(backend)
        if not self.cfg.enabled or st is None or st.until is None or st.probe_at is None:
            return None
        return self.slow_threshold(surface, backend)

    def slow_threshold(self, surface: str, backend: str) -> float | None:
        """The TTFT from which ``backend``'s first token on ``surface`` is slow (None: no baseline
        yet): a hedge delay above it waits out what is already a brownout's first token."""
        base = self.baseline(surface, backend)
        return None if base is None else self._slow_from(base)

    def _slow_from(self, base: float) -> float:
        """The TTFT from which a first token is slow against the baseline ``base``."""
        return max(self.cfg.slow_factor * base, base + self.cfg.min_excess_s)

    def order(self, candidates: list[str], now: float) -> list[str]:
        """``candidates`` with the demoted ones last; a backend on probation with no probe out
        keeps its place for this request (its probe)."""
        demoted = [c for c in candidates if self.demoted(c, now)]
        if len(demoted) < len(candidates):
            candidates = [c for c in candidates if c not in demoted] + demoted
        first = self._states.get(candidates[0]) if candidates and self.cfg.enabled else None
        if first is not None and first.until is not None and now >= first.until:
            first.probe_at = now  # on probation, and this request is its probe
        return candidates

    def status(self, now: float) -> dict[str, dict[str, float | int | bool | dict[str, float] | None]]:
        """Per backend seen: demoted now, seconds left, whether a probe is out, demotions so far,
        and per surface the first token (ms) from which it is slow (operators' status)."""
        out: dict[str, dict[str, float | int | bool | dict[str, float] | None]] = {}
        for name, st in self._states.items():
            surfaces = sorted(s for s, b in self._baseline if b == name)
            slow_from = {s: self.slow_threshold(s, name) for s in surfaces}
            out[name] = {
                "demoted": self.demoted(name, now),
                "left_s": None if st.until is None else round(max(0.0, st.until - now), 2),
                "probe_out": st.probe_at is not None,
                "demotions": st.demotions,
                "slow_from_ms": {s: round(1000 * v, 1) for s, v in slow_from.items() if v is not None},
            }
        return out
