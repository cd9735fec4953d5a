"""Awaitable admission slots over the synchronous :class:`cluster.policy.admission.AdmissionController`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from cluster.policy.admission import AdmissionController
from cluster.policy.admission_types import Outcome, Rejection, Ticket


class AsyncAdmission:
    """Awaitable slots over an :class:`AdmissionController`: ``async with adm.slot(surface): ...``.

    Waiters are futures resolved by releases and by a timer armed on the earliest deadline, so a
    waiter always ends by its deadline. A waiter cancelled while queued is abandoned; one cancelled
    just after being admitted releases its ticket as cancelled (exactly once).
    """

    def __init__(self, controller: AdmissionController, clock: Callable[[], float] = time.monotonic) -> None:
        self.controller = controller
        self.clock = clock
        self._waiters: dict[int, asyncio.Future[Ticket]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    async def acquire(
        self, surface: str, candidates: Sequence[str] = (), tenant: str | None = None
    ) -> Ticket:
        """A ticket, or raises ``RateLimited``/``Overloaded``."""
        now = self.clock()
        self._settle(self.controller.expire(now), [])
        result = self.controller.try_admit(surface, now, candidates, tenant)
        self._settle(self.controller.take_pushed_out(), [])  # the places it took: answered at once
        if isinstance(result, Ticket):
            return result
        if isinstance(result, Rejection):
            raise result.error
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiters[result.id] = fut
        self._arm()
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(result.id, None)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), Outcome.CANCELLED)  # admitted, but nobody will use it
            elif self.controller.cancel(result.id, self.clock()):
                self._arm()
            raise

    def precheck(self, surface: str, tenant: str | None = None) -> None:
        """Raises the rejection a new request of ``surface`` (``tenant``'s) would get whatever it asks for."""
        now = self.clock()
        self._settle(self.controller.expire(now), [])
        rejection = self.controller.precheck(surface, now, tenant)
        if rejection is not None:
            raise rejection.error

    def release(self, ticket: Ticket, outcome: Outcome | str) -> None:
        now = self.clock()
        admitted = self.controller.release(ticket, outcome, now)
        self._settle(self.controller.expire(now), admitted)

    def set_guard_caps(self, caps: Mapping[str, int | None]) -> None:
        admitted, rejected = self.controller.set_guard_caps(caps, self.clock())
        self._settle(rejected, admitted)

    def transfer(self, ticket: Ticket, backend: str) -> Ticket | None:
        moved, admitted = self.controller.transfer(ticket, backend, self.clock())
        self._settle([], admitted)
        return moved

    @asynccontextmanager
    async def slot(self, surface: str, candidates: Sequence[str] = ()) -> AsyncIterator[Ticket]:
        """Holds a slot for the block; its outcome is completed, errored (an exception) or
        cancelled (``CancelledError``, e.g. the client went away)."""
        ticket = await self.acquire(surface, candidates)
        outcome = Outcome.COMPLETED
        try:
            yield ticket
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            raise
        except BaseException:
            outcome = Outcome.ERRORED
            raise
        finally:
            self.release(ticket, outcome)

    def pending(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None

    def _settle(self, rejected: list[Rejection], admitted: list[Ticket]) -> None:
        for rej in rejected:
            fut = self._waiters.pop(rej.entry_id, None) if rej.entry_id is not None else None
            if fut is not None and not fut.done():
                fut.set_exception(rej.error)
        for ticket in admitted:
            fut = self._waiters.pop(ticket.id, None)
            if fut is not None and not fut.done():
                fut.set_result(ticket)
            else:  # the waiter was cancelled in the meantime: give the slot back at once
                more = self.controller.release(ticket, Outcome.CANCELLED, self.clock())
                self._settle([], more)
        self._arm()

    def _arm(self) -> None:
        deadline = self.controller.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
        if deadline is not None:
            delay = max(0.0, deadline - self.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
            self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._settle(self.controller.expire(self.clock()), [])
