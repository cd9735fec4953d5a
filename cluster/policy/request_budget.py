"""One shape for the budgets that ration *extra* attempts by the requests seen (issue 43 item 4):
a primary request **deposits**, an extra attempt **spends** one if there is room, and an extra
attempt that was paid for but never sent is **refunded**. Pure: every call passes ``now``.

Two budgets have this shape, because they are two different rations, not two spellings of one:

* :class:`cluster.policy.hedging.HedgeBudget`: a token bucket filled by requests (``ratio`` per
  request, up to ``burst``), so at every moment hedges <= ratio x requests; time plays no part.
* :class:`cluster.policy.failover.RetryBudget` (retries, and mid-stream migrations through
  :class:`cluster.policy.migration.MigrationPolicy`): a sliding window, ``ratio`` x the window's
  requests plus ``min_per_s`` x its length, minus what was spent in it.

The rate budgets of tenants and providers (RPM / TPM) are the other interface,
:mod:`cluster.policy.rate_budget`: they ration requests and tokens by time, not attempts by requests.
"""

from __future__ import annotations

from typing import Protocol


class RequestBudget(Protocol):
    def deposit(self, now: float) -> None:
        """One primary request was sent: it earns the budget its ratio."""

    def try_spend(self, now: float) -> bool:
        """Take one extra attempt's worth if there is room (True: taken)."""

    def refund(self, now: float) -> None:
        """An extra attempt that was paid for and never sent gives its worth back."""
