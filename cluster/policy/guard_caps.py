"""The SLO guard's caps as admission applies them: deferrable work in flight per backend.

A *deferrable* surface (every surface but those with the lowest priority number) may start a
request on a capped backend while the deferrable work in flight there is under the cap, **or**
while that surface's own requests there are under ``floor``. The floor is per surface: a cap of 1
taken by a long Agent stream must not shut Chat out for the stream's whole length (the guard
defers lower-priority work; it never starves a surface). Pure bookkeeping, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class GuardCaps:
    def __init__(self, deferrable: Iterable[str], floor: int = 0) -> None:
        if floor < 0:
            raise ValueError("floor must be >= 0")
        self.deferrable = frozenset(deferrable)
        self.floor = floor
        self._caps: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}  # by backend: every deferrable surface's tickets
        self._own: dict[tuple[str, str], int] = {}  # (backend, surface) -> that surface's tickets

    def set(self, caps: Mapping[str, int | None]) -> bool:
        """New caps (None: uncapped). True when a cap appeared or went down."""
        lowered = False
        for backend, cap in caps.items():
            old = self._caps.get(backend)
            if cap is None:
                self._caps.pop(backend, None)
            else:
                lowered = lowered or old is None or cap < old
                self._caps[backend] = cap
        return lowered

    def has_room(self, backend: str, surface: str) -> bool:
        cap = self._caps.get(backend) if surface in self.deferrable else None
        if cap is None or self._in_flight.get(backend, 0) < cap:
            return True
        return self._own.get((backend, surface), 0) < self.floor

    def binds_all(self, backends: Iterable[str], surface: str) -> bool:
        """The guard's caps, not static limits, keep ``surface`` off every one of ``backends`` now."""
        caps = self._caps
        return surface in self.deferrable and all(
            b in caps and not self.has_room(b, surface) for b in backends
        )

    def count(self, backend: str, surface: str, delta: int) -> None:
        if surface in self.deferrable:
            self._in_flight[backend] = self._in_flight.get(backend, 0) + delta
            key = (backend, surface)
            self._own[key] = self._own.get(key, 0) + delta

    def in_flight(self) -> dict[str, int]:
        """Deferrable work in flight, by backend (what the guard caps)."""
        return dict(self._in_flight)

    def skip(self, surface: str) -> int:
        """How many of ``surface``'s own next completions free no slot for its waiters: on a capped
        backend a completion frees one once the work in flight there falls under the cap or the
        surface's own under the floor (the most over any capped backend: a cautious estimate)."""
        if surface not in self.deferrable:
            return 0
        worst = 0
        for backend, cap in self._caps.items():
            over = self._in_flight.get(backend, 0) - cap
            if self.floor:
                over = min(over, self._own.get((backend, surface), 0) - self.floor)
            worst = max(worst, over)
        return worst
