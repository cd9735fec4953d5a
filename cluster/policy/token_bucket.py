"""Token buckets for the tenants' request and token budgets (:mod:`cluster.policy.tenants`; pure: every
call passes ``now``).

:class:`TokenBucket` is the refill-per-second bucket; :class:`BucketBudget` is a
:class:`cluster.policy.rate_budget.RateLimiter`: it reserves one request and
``input estimate + max_tokens`` tokens up front and settles with the actual usage afterwards
(giving back the unused part, or taking the overrun as debt). A provider's budget is the other
limiter behind the same interface: sliding windows, as the provider counts
(:class:`cluster.providers.budget.ProviderBudget`).
"""

from __future__ import annotations

import math

from cluster.policy.rate_budget import Refusal, Reservation, Snapshot


class TokenBucket:
    """``capacity`` tokens, refilled at ``refill_per_s``; the level may go below zero (debt) when a
    settlement takes more than was reserved. Pure: every call passes ``now``."""

    def __init__(self, capacity: float, refill_per_s: float, now: float, level: float | None = None) -> None:
        if capacity <= 0 or refill_per_s < 0:
            raise ValueError("capacity must be > 0 and refill_per_s >= 0")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._level = self.capacity if level is None else float(level)
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:  # a clock that steps back refills nothing
            self._level = min(self.capacity, self._level + (now - self._t) * self.refill_per_s)
            self._t = now

    def level(self, now: float) -> float:
        self._refill(now)
        return self._level

    def try_take(self, n: float, now: float) -> bool:
        self._refill(now)
        if n <= self._level:
            self._level -= n
            return True
        return False

    def take(self, n: float, now: float) -> None:
        """Take unconditionally (an overrun found when settling): the level may go negative."""
        self._refill(now)
        self._level -= n

    def give_back(self, n: float, now: float) -> None:
        self._refill(now)
        self._level = min(self.capacity, self._level + n)

    def time_until(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (0: now; inf: never, ``n`` exceeds the capacity)."""
        self._refill(now)
        if n <= self._level:
            return 0.0
        if n > self.capacity or self.refill_per_s == 0:
            return math.inf
        return (n - self._level) / self.refill_per_s


class BucketBudget:
    """A tenant's RPM and TPM budgets (this gateway replica's share). ``burst_s`` sizes the
    buckets: 60 s holds a minute's worth; lower it for a smoother limit on shorter windows.
    ``request_burst_s`` sizes the request bucket alone (default: ``burst_s``), so that requests can
    be smoothed while one large request still fits a minute's tokens."""

    def __init__(
        self,
        rpm: int | None,
        tpm: int | None,
        now: float,
        *,
        router_replicas: int = 1,
        burst_s: float = 60.0,
        request_burst_s: float | None = None,
    ) -> None:
        self.rpm = self._bucket(rpm, router_replicas, request_burst_s or burst_s, now)
        self.tpm = self._bucket(tpm, router_replicas, burst_s, now)

    @staticmethod
    def _bucket(per_min: int | None, routers: int, burst_s: float, now: float) -> TokenBucket | None:
        if per_min is None:
            return None
        rate = per_min / routers / 60.0
        return TokenBucket(max(1.0, rate * burst_s), rate, now)

    def reserve(self, key: str, input_tokens: int, max_tokens: int, now: float) -> Reservation | Refusal:
        """Both budgets or neither: one request and ``input_tokens + max_tokens`` tokens."""
        tokens = input_tokens + max_tokens
        rpm_wait = self.rpm.time_until(1, now) if self.rpm is not None else 0.0
        tpm_wait = self.tpm.time_until(tokens, now) if self.tpm is not None else 0.0
        wait = max(rpm_wait, tpm_wait)
        if wait == math.inf:
            msg = f"request of {tokens} tokens exceeds the provider's token budget per window"
            return Refusal("too_large", None, msg, all_refused_s=rpm_wait)
        if wait > 0:
            reason = "rpm" if rpm_wait >= tpm_wait else "tpm"
            return Refusal(reason, wait, "provider rate budget exhausted", all_refused_s=rpm_wait)
        if self.rpm is not None:
            self.rpm.take(1, now)
        if self.tpm is not None:
            self.tpm.take(tokens, now)
        return Reservation(key, tokens)

    def settle(self, reservation: Reservation, tokens: int, now: float) -> None:
        """The request ended: give back what it did not use, or take its overrun as debt."""
        if self.tpm is None:
            return
        diff = reservation.tokens - tokens
        if diff > 0:
            self.tpm.give_back(diff, now)
        elif diff < 0:
            self.tpm.take(-diff, now)

    def cancel(self, reservation: Reservation, now: float) -> None:
        """Never sent upstream: both budgets get their share back."""
        if self.rpm is not None:
            self.rpm.give_back(1, now)
        if self.tpm is not None:
            self.tpm.give_back(reservation.tokens, now)

    def snapshot(self, now: float) -> Snapshot:
        """The buckets' levels (None: no such budget)."""
        return {
            "rpm_level": self.rpm.level(now) if self.rpm is not None else None,
            "tpm_level": self.tpm.level(now) if self.tpm is not None else None,
        }
