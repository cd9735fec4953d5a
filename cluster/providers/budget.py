"""A provider's RPM / TPM / in-flight budget: the sliding-window limiter behind
:class:`cluster.policy.rate_budget.RateLimiter` (the tenants' is the token bucket). Pure: the clock
is passed in.

Admission reserves the input estimate plus ``max_tokens`` (the most the request can use, which is
how providers count TPM too), keyed by the request id (reserving an id twice is one reservation);
settling swaps the reservation for the tokens the provider reported, which are authoritative.
Both limits are sliding windows over the admissions of the last ``window_s`` seconds: an
admission stays counted in the request window until it leaves it, whatever became of the request
(cancelling gives back its tokens only). A reservation that is never settled or cancelled (a
crashed caller) expires after ``reservation_ttl_s`` so that a leak cannot close the budget for good.
What a request cost is not the budget's business: :func:`cluster.cost.cost_usd`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.config import ProviderConfig
from cluster.cost import Prices, cost_usd
from cluster.policy.rate_budget import Refusal, Reservation, Snapshot

__all__ = ["IN_FLIGHT_RETRY_S", "Prices", "ProviderBudget", "Refusal", "Reservation", "cost_usd"]

IN_FLIGHT_RETRY_S = 1.0  # a slot frees when some request ends; we cannot know when
_MESSAGES = {
    "in_flight": "too many requests in flight",
    "rpm": "requests per minute spent",
    "tpm": "tokens per minute spent",
    "too_large": "the request is larger than the token budget",
}


@dataclass(slots=True)
class _Entry:
    request_id: str
    t: float
    tokens: int
    in_window: bool = True


class ProviderBudget:
    def __init__(
        self,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_in_flight: int | None = None,
        window_s: float = 60.0,
        reservation_ttl_s: float = 900.0,
    ) -> None:
        self.rpm, self.tpm, self.max_in_flight = rpm, tpm, max_in_flight
        self.window_s = window_s
        self.reservation_ttl_s = reservation_ttl_s
        self._window: deque[_Entry] = deque()
        self._window_tokens = 0
        self._active: dict[str, _Entry] = {}
        self.admitted = 0
        self.denied: dict[str, int] = {}
        self.expired = 0

    @classmethod
    def from_config(cls, cfg: ProviderConfig, *, window_s: float = 60.0) -> ProviderBudget:
        return cls(
            rpm=cfg.rpm,
            tpm=cfg.tpm,
            max_in_flight=cfg.max_in_flight,
            window_s=window_s,
            reservation_ttl_s=cfg.total_timeout_s + 60.0,
        )

    def configure(self, cfg: ProviderConfig) -> None:
        """New limits from a changed config; the windows keep what they counted."""
        self.rpm, self.tpm, self.max_in_flight = cfg.rpm, cfg.tpm, cfg.max_in_flight

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def reserve(self, key: str, input_tokens: int, max_tokens: int, now: float) -> Reservation | Refusal:
        """``key``: the request id."""
        self._expire(now)
        tokens = max(0, input_tokens) + max(0, max_tokens)
        if key in self._active:
            return Reservation(key, self._active[key].tokens)
        denial = self._check(tokens, now)
        if denial is not None:
            self.denied[denial.reason] = self.denied.get(denial.reason, 0) + 1
            return denial
        entry = _Entry(key, now, tokens)
        self._window.append(entry)
        self._window_tokens += tokens
        self._active[key] = entry
        self.admitted += 1
        return Reservation(key, tokens)

    def settle(self, reservation: Reservation, tokens: int, now: float) -> None:
        """The request ended having used ``tokens`` (the provider's usage, else an estimate of what
        it read and wrote): the window counts those instead of the reservation."""
        self._finish(reservation.key, tokens)
        self._expire(now)

    def cancel(self, reservation: Reservation, now: float) -> None:
        """Never served: its tokens go back; its admission stays in the request window."""
        self.settle(reservation, 0, now)

    def snapshot(self, now: float) -> Snapshot:
        self._expire(now)
        return {
            "in_flight": len(self._active),
            "window_requests": len(self._window),
            "window_tokens": self._window_tokens,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_in_flight": self.max_in_flight,
            "admitted": self.admitted,
            "denied": sum(self.denied.values()),
            "expired_reservations": self.expired,
        }

    # ------------------------------------------------------------------------------------------
    def _check(self, tokens: int, now: float) -> Refusal | None:
        if self.max_in_flight is not None and len(self._active) >= self.max_in_flight:
            return _refusal("in_flight", IN_FLIGHT_RETRY_S)
        if self.rpm is not None and len(self._window) >= self.rpm:
            oldest_needed = self._window[len(self._window) - self.rpm]
            return _refusal("rpm", max(0.0, oldest_needed.t + self.window_s - now))
        if self.tpm is not None and self._window_tokens + tokens > self.tpm:
            if tokens > self.tpm:
                return _refusal("too_large", None)
            freed, need = 0, self._window_tokens + tokens - self.tpm
            for e in self._window:
                freed += e.tokens
                if freed >= need:
                    return _refusal("tpm", max(0.0, e.t + self.window_s - now))
        return None

    def _finish(self, request_id: str, tokens: int) -> None:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return
        if entry.in_window:
            self._window_tokens += max(0, tokens) - entry.tokens
        entry.tokens = max(0, tokens)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._window and self._window[0].t <= horizon:
            e = self._window.popleft()
            e.in_window = False
            self._window_tokens -= e.tokens
        stale = now - self.reservation_ttl_s
        if self._active and next(iter(self._active.values())).t <= stale:
            for rid in [rid for rid, e in self._active.items() if e.t <= stale]:
                del self._active[rid]
                self.expired += 1


def _refusal(reason: str, retry_after_s: float | None) -> Refusal:
    return Refusal(reason, retry_after_s, _MESSAGES[reason])
