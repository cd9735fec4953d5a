"""One rate-budget interface for every RPM / TPM limit we keep: a request **reserves** (one request
and ``input estimate + max_tokens`` tokens) before it is sent and gets a :class:`Reservation` or a
:class:`Refusal`; when it ends it **settles** with the tokens it really used (the unused part goes
back, an overrun is taken), or it is **cancelled** (never served). Pure: every call passes ``now``.

Two limiters sit behind it, because they are two different limits, not two spellings of one:

* :class:`cluster.policy.token_bucket.BucketBudget` (a tenant's budget): token buckets that refill
  continuously and may go into debt; a refusal says when the bucket has room again, and a cancelled
  request gives its request and its tokens back.
* :class:`cluster.providers.budget.ProviderBudget` (a provider's budget): sliding windows over the
  admissions of the last ``window_s`` seconds plus an in-flight cap, counted as the provider counts
  them; a request once admitted stays counted in the request window, cancelled or not, and a
  reservation that is never settled expires.

Either runs in one process or behind the app's shared-budget deployment
(``deployments/budgets/budget_deployment.py``), which speaks this interface over a Serve handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one request holds of a budget until it settles or is cancelled."""

    key: str  # whose: the tenant (tenants' buckets), the request id (a provider's window)
    tokens: int  # input estimate + max_tokens, taken from the token budget


@dataclass(frozen=True, slots=True)
class Refusal:
    """No room now. ``retry_after_s``: when this request would fit (None: never, it is larger than
    the token budget itself); ``all_refused_s``: how long *every* request is refused whatever its
    size (0: only this one, a smaller one might pass)."""

    reason: str  # "rpm", "tpm", "in_flight", "too_large"
    retry_after_s: float | None
    message: str
    all_refused_s: float = 0.0


Snapshot = dict[str, float | int | None]


class RateLimiter(Protocol):
    """A budget some requests draw from. ``reserve`` returns None when no limit applies to ``key``
    (a tenant without a budget): nothing to settle then."""

    def reserve(
        self, key: str, input_tokens: int, max_tokens: int, now: float
    ) -> Reservation | Refusal | None:
        """Both the request and its tokens, or neither."""
        ...

    def settle(self, reservation: Reservation, tokens: int, now: float) -> None:
        """The request ended having used ``tokens``: charge those instead of the reservation."""
        ...

    def cancel(self, reservation: Reservation, now: float) -> None:
        """The request was never served: give back what this kind of limit gives back."""
        ...

    def snapshot(self, now: float) -> Snapshot:
        """Counts for the status page and tests."""
        ...
