"""The simulated engine's waiting queue, in vLLM v1's two orders (``vllm/v1/core/sched/request_queue.py``).

* ``fcfs``: arrival order; a preempted request goes back to the front.
* ``priority``: lowest ``priority`` number first, then the earliest arrival (vLLM's
  ``Request.__lt__``); a preempted request re-enters by the same key (vLLM's
  ``PriorityRequestQueue.prepend_request`` is a plain add), so it keeps its place by priority.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Generic, Literal, Protocol, TypeVar

SchedulingPolicy = Literal["fcfs", "priority"]


class Queueable(Protocol):
    priority: int
    arrival_time: float


R = TypeVar("R", bound=Queueable)


class WaitQueue(Generic[R]):
    """A waiting queue in one of the two orders; O(log n) add/pop in priority order."""

    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy '{policy}'")
        self.policy = policy
        self._fifo: deque[R] = deque()
        self._heap: list[tuple[int, float, int, R]] = []
        self._seq = itertools.count()  # ties (same priority and arrival) keep insertion order

    def add(self, req: R) -> None:
        """A new arrival."""
        if self.policy == "fcfs":
            self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    def prepend(self, req: R) -> None:
        """A preempted request coming back."""
        if self.policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            self.add(req)

    def peek(self) -> R:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> R:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, req: R) -> None:
        """Take one request out wherever it is (an abort); ValueError if it is not queued."""
        if self.policy == "fcfs":
            self._fifo.remove(req)
            return
        for i, item in enumerate(self._heap):
            if item[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("request not in the waiting queue")

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[R]:
        """In scheduling order."""
        if self.policy == "fcfs":
            return iter(list(self._fifo))
        return iter([item[3] for item in sorted(self._heap, key=lambda x: x[:3])])
