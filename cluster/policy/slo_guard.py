"""SLO-aware admission: cap lower-priority work on a backend while the protected surface's recent
TTFT on it nears its objective, and lift the cap when it recovers or goes quiet.

The *protected* surfaces are those with the lowest priority number (Tab); every other surface's
work is *deferrable*. Per backend the guard keeps the protected surfaces' recent TTFT samples and
a cap on deferrable requests in flight there (None: no cap beyond the static limits), adjusted
every ``interval_s`` by :meth:`SloGuard.update`, AIMD-style:

* **pressure**: the ``quantile`` of the samples since the last change is at least
  ``pressure_fraction`` x the surface's objective → cap = ``decrease_factor`` x (the current cap, or
  the deferrable work in flight when uncapped), at least ``min_cap``. Only samples taken after a
  change count towards the next one, so one slow burst does not cut the cap twice.
* **recovered** (the quantile under ``recover_fraction`` x objective) → cap + ``increase_step``;
  once it reaches ``ceiling`` (the static limit) or no longer binds, the cap is gone.
* **quiet**: no protected request arrived on any backend for ``quiet_s`` → no cap at all, so spare
  capacity goes to deferrable work at once when Tab is quiet.
* otherwise (between the two fractions, or too few samples) the cap holds.

Only engine backends (replicas the app runs) are guarded (:func:`guarded_backends`): there the
protected and the deferred work share the engines' steps, so deferring the one speeds the other. A
provider's TTFT does not depend on how much of our deferrable work it carries; a cap there would
refuse requests and help no one.

The samples are this gateway's own clients' TTFTs plus, for engine backends, the engines' own
(:meth:`SloGuard.absorb`: each replica reports the TTFT of every gateway's requests through Serve's
routing stats), so that every gateway replica acts on the same picture of the shared replicas.

Deferred work waits in admission's queue (and is rejected at once when its predicted wait passes
its deadline). Pure: ``now`` and the loads are passed in; the gateway drives it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pydantic import Field

from cluster.base import Strict
from cluster.json_types import JSONObject

if TYPE_CHECKING:
    from cluster.config import BackendConfig, SurfaceConfig


CHANGES_KEPT = 32  # cap changes the status page shows


class SloGuardConfig(Strict):
    enabled: bool = Field(True, description="Cap lower-priority work while the top surface nears its SLO.")
    interval_s: float = Field(0.5, gt=0, description="How often the caps are revised.")
    window_s: float = Field(10.0, gt=0, description="TTFT samples older than this are forgotten.")
    quantile: float = Field(0.9, gt=0, le=1, description="TTFT quantile compared with the objective.")
    min_samples: int = Field(
        10,
        gt=0,
        description=(
            "Samples since the last change needed to act on them. 10: the fewest whose 0.9 quantile "
            "is not their slowest one (with 4, one slow first token of four halved the cap)."
        ),
    )
    pressure_fraction: float = Field(
        0.8, gt=0, description="Cap deferrable work when the quantile reaches this share of the SLO."
    )
    recover_fraction: float = Field(
        0.5, gt=0, description="Raise the cap again when the quantile is under this share of the SLO."
    )
    decrease_factor: float = Field(0.5, gt=0, lt=1, description="Cap multiplier under pressure.")
    increase_step: int = Field(2, gt=0, description="Cap increase per interval once recovered.")
    min_cap: int = Field(
        1, ge=0, description="Fewest requests of each deferrable surface always allowed per backend."
    )
    quiet_s: float = Field(2.0, gt=0, description="No protected arrival for this long lifts every cap.")
    queue_while_capped: bool = Field(
        False,
        description="Queue deferrable requests behind a binding cap (False: refuse them at once, 429).",
    )
    retry_after_s: float = Field(
        2.0,
        gt=0,
        description=(
            "Most Retry-After a refusal by the cap gets: a cap is revised every interval_s on new "
            "samples (those of the rehearsals lasted 0.5-2.5 s), so admission's queue estimate "
            "(15-30 s there) would keep a client away long after the cap is gone."
        ),
    )


def guarded_backends(backends: Iterable[BackendConfig]) -> list[str]:
    """The backends the guard caps: the engines (:class:`cluster.backend_kind.KindCaps`
    ``engine_replicas``), never a provider. Measured: in the production rehearsal a loopback
    provider whose first token takes 100 ms held Tab's p90 there at 0.8x its 100 ms objective for
    good, so the provider stayed capped at ``min_cap`` and a Chat request the provider could have
    served got a 429 (``loadtest/results/rehearsal.json``, the upgrade)."""
    return [b.name for b in backends if b.kind.caps.engine_replicas]


@dataclass(slots=True)
class _Backend:
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, ttft / slo)
    cap: int | None = None
    changed_at: float = -math.inf


@dataclass(frozen=True, slots=True)
class GuardState:
    backend: str
    cap: int | None
    quantile_ratio: float | None  # the protected TTFT quantile over its SLO, since the last change
    reason: str  # "quiet", "pressure", "recovered", "hold", "uncapped"


@dataclass(frozen=True, slots=True)
class GuardChange:
    """One change of a cap, kept for the status page: why deferrable work was refused, and when."""

    at: float  # the clock ``update`` was given
    state: GuardState
    samples: int  # the protected first tokens the quantile was taken over


class SloGuard:
    def __init__(
        self, cfg: SloGuardConfig, surfaces: Mapping[str, tuple[int, float]], backends: Iterable[str]
    ) -> None:
        """``surfaces``: name -> (priority, TTFT objective in seconds)."""
        self.cfg = cfg
        top = min(p for p, _ in surfaces.values())
        self.top_priority = top
        self.slo_s = {name: slo for name, (p, slo) in surfaces.items() if p == top}
        self._engine_slo_s = min(self.slo_s.values())  # engines know a request's priority only
        self._seen: dict[tuple[str, str], int] = {}  # (backend, replica) -> last engine sample seen
        self.deferrable = frozenset(name for name, (p, _) in surfaces.items() if p != top)
        self._backends = {b: _Backend() for b in backends}
        self._last_protected = -math.inf
        self.last: dict[str, GuardState] = {}
        self.changes: deque[GuardChange] = deque(maxlen=CHANGES_KEPT)  # the latest cap changes

    @classmethod
    def for_surfaces(
        cls, cfg: SloGuardConfig, surfaces: Iterable[SurfaceConfig], backends: Iterable[str]
    ) -> SloGuard:
        """From ``SurfaceConfig``-like objects (name, priority, ttft_slo_ms)."""
        return cls(cfg, {s.name: (s.priority, s.ttft_slo_ms / 1000.0) for s in surfaces}, backends)

    def arrived(self, surface: str, now: float) -> None:
        if surface in self.slo_s:
            self._last_protected = now

    def observe(self, surface: str, backend: str, ttft_s: float, now: float) -> None:
        """A first token reached the client (per request, never per chunk)."""
        slo = self.slo_s.get(surface)
        b = self._backends.get(backend)
        if slo is not None and b is not None:
            b.samples.append((now, ttft_s / slo))

    def absorb(
        self, backend: str, replica: str, samples: Iterable[tuple[int, float, int, float]], now: float
    ) -> int:
        """An engine replica's own TTFT samples (:class:`cluster.policy.ttft_window.TtftWindow`: every
        gateway's requests there, so every gateway's guard sees the same ones), each counted once
        however often it is read; those of the protected priority join this backend's samples,
        against the tightest protected objective. Returns how many were new."""
        b = self._backends.get(backend)
        if b is None:
            return 0
        key = (backend, replica)
        last = self._seen.get(key, 0)
        added = 0
        for seq, age_s, priority, ttft_s in samples:
            if seq <= last:
                continue
            last = seq
            if priority == self.top_priority:  # protected work is active, whichever gateway took it
                b.samples.append((now - age_s, ttft_s / self._engine_slo_s))
                self._last_protected = max(self._last_protected, now - age_s)
                added += 1
        self._seen[key] = last
        return added

    def sample_counts(self) -> dict[str, int]:
        """Per backend, the protected TTFT samples it holds (its own clients' and the engines')."""
        return {name: len(b.samples) for name, b in self._backends.items()}

    def forget_replicas(self, backend: str, live: Iterable[str]) -> None:
        """Replicas no longer live: their sequence numbers go (a bounded table)."""
        keep = set(live)
        for key in [k for k in self._seen if k[0] == backend and k[1] not in keep]:
            del self._seen[key]

    def update(
        self, now: float, deferrable_in_flight: Mapping[str, int], ceiling: Mapping[str, int | None]
    ) -> dict[str, int | None]:
        """The caps on deferrable work per backend from now on."""
        caps: dict[str, int | None] = {}
        for name, b in self._backends.items():
            state = self._revise(name, b, now, deferrable_in_flight.get(name, 0), ceiling.get(name))
            self.last[name] = state
            caps[name] = state.cap
        return caps

    def _revise(self, name: str, b: _Backend, now: float, low: int, ceiling: int | None) -> GuardState:
        cfg = self.cfg
        horizon = now - cfg.window_s
        while b.samples and b.samples[0][0] <= horizon:
            b.samples.popleft()
        if not cfg.enabled or now - self._last_protected >= cfg.quiet_s:
            b.cap = None
            return GuardState(name, None, None, "quiet" if cfg.enabled else "uncapped")
        # Engine samples arrive up to a stats period late, so the deque is only nearly in time
        # order: the window and the last change are checked per sample.
        since = max(b.changed_at, horizon)
        ratios = sorted(r for t, r in b.samples if t > since)
        if len(ratios) < cfg.min_samples:
            return GuardState(name, b.cap, None, "hold")
        q = ratios[min(len(ratios) - 1, math.ceil(cfg.quantile * len(ratios)) - 1)]
        if q >= cfg.pressure_fraction:
            base = b.cap if b.cap is not None else low
            b.cap = max(cfg.min_cap, math.floor(base * cfg.decrease_factor))
            return self._changed(b, GuardState(name, b.cap, q, "pressure"), now, len(ratios))
        if q < cfg.recover_fraction and b.cap is not None:
            b.cap += cfg.increase_step
            if (ceiling is not None and b.cap >= ceiling) or b.cap > low + cfg.increase_step:
                b.cap = None  # at the static limit, or no longer binding: deferrable demand fell
            return self._changed(b, GuardState(name, b.cap, q, "recovered"), now, len(ratios))
        return GuardState(name, b.cap, q, "hold" if b.cap is not None else "uncapped")

    def _changed(self, b: _Backend, state: GuardState, now: float, samples: int) -> GuardState:
        b.changed_at = now
        self.changes.append(GuardChange(now, state, samples))
        return state

    def recent_changes(self, now: float) -> list[JSONObject]:
        """The latest cap changes, oldest first, each with its age in seconds (the status page)."""
        return [
            {"age_s": round(now - c.at, 1), "samples": c.samples, **asdict(c.state)} for c in self.changes
        ]
