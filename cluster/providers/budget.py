"""A provider's RPM / TPM / in-flight budget, and what a request cost. Pure: the clock is passed in.

Admission reserves the input estimate plus ``max_tokens`` (the most the request can use, which is
how providers count TPM too); settling swaps the reservation for the usage the provider reported,
which is authoritative. Both limits are sliding windows over the admissions of the last
``window_s`` seconds. A reservation that is never settled or released (a crashed caller) expires
after ``reservation_ttl_s`` so that a leak cannot close the budget for good.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.config import ProviderConfig
from cluster.cost import Prices, cost_usd
from cluster.wire.protocol import Usage

IN_FLIGHT_RETRY_S = 1.0  # a slot frees when some request ends; we cannot know when


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    reason: str = ""  # "", "rpm", "tpm", "in_flight", "too_large"
    retry_after_s: float | None = None
    reserved_tokens: int = 0


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
        prices: Prices | None = None,
        window_s: float = 60.0,
        reservation_ttl_s: float = 900.0,
    ) -> None:
        self.rpm, self.tpm, self.max_in_flight = rpm, tpm, max_in_flight
        self.prices = prices or Prices()
        self.window_s = window_s
        self.reservation_ttl_s = reservation_ttl_s
        self._window: deque[_Entry] = deque()
        self._window_tokens = 0
        self._active: dict[str, _Entry] = {}
        self.admitted = 0
        self.denied: dict[str, int] = {}
        self.expired = 0
        self.cost_usd_total = 0.0

    @classmethod
    def from_config(cls, cfg: ProviderConfig, *, window_s: float = 60.0) -> ProviderBudget:
        return cls(
            rpm=cfg.rpm,
            tpm=cfg.tpm,
            max_in_flight=cfg.max_in_flight,
            prices=Prices.from_config(cfg),
            window_s=window_s,
            reservation_ttl_s=cfg.total_timeout_s + 60.0,
        )

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def try_reserve(self, request_id: str, input_tokens: int, max_tokens: int, now: float) -> Admission:
        self._expire(now)
        tokens = max(0, input_tokens) + max(0, max_tokens)
        if request_id in self._active:
            return Admission(True, reserved_tokens=self._active[request_id].tokens)
        denial = self._check(tokens, now)
        if denial is not None:
            self.denied[denial.reason] = self.denied.get(denial.reason, 0) + 1
            return denial
        entry = _Entry(request_id, now, tokens)
        self._window.append(entry)
        self._window_tokens += tokens
        self._active[request_id] = entry
        self.admitted += 1
        return Admission(True, reserved_tokens=tokens)

    def settle(self, request_id: str, usage: Usage, now: float) -> float:
        """The request ended with the provider's usage: charge that instead of the reservation."""
        self._finish(request_id, usage.total_tokens)
        cost = cost_usd(usage, self.prices)
        self.cost_usd_total += cost
        self._expire(now)
        return cost

    def release(self, request_id: str, now: float, tokens_used: int = 0) -> None:
        """The request ended without usage (failed, cancelled): charge ``tokens_used`` (an estimate)."""
        self._finish(request_id, tokens_used)
        self._expire(now)

    def snapshot(self, now: float) -> dict[str, float | int | None]:
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
            "cost_usd_total": self.cost_usd_total,
        }

    # ------------------------------------------------------------------------------------------
    def _check(self, tokens: int, now: float) -> Admission | None:
        if self.max_in_flight is not None and len(self._active) >= self.max_in_flight:
            return Admission(False, "in_flight", IN_FLIGHT_RETRY_S)
        if self.rpm is not None and len(self._window) >= self.rpm:
            oldest_needed = self._window[len(self._window) - self.rpm]
            return Admission(False, "rpm", max(0.0, oldest_needed.t + self.window_s - now))
        if self.tpm is not None and self._window_tokens + tokens > self.tpm:
            if tokens > self.tpm:
                return Admission(False, "too_large", None)
            freed, need = 0, self._window_tokens + tokens - self.tpm
            for e in self._window:
                freed += e.tokens
                if freed >= need:
                    return Admission(False, "tpm", max(0.0, e.t + self.window_s - now))
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
