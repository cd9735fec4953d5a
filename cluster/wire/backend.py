"""The one interface every backend speaks (vLLM replica, simulated engine, provider adapter).

The router never cares which kind it talks to. A backend replica:

* ``generate(req)`` — an async stream of :class:`Chunk` for one :class:`GenerateRequest`; the
  last chunk carries ``finish_reason`` and ``usage``. Failures *before* the first content chunk
  raise a :class:`cluster.wire.errors.ClusterError` whose ``action`` tells the router whether to try
  elsewhere; a failure *after* it raises :class:`StreamInterrupted`. Cancelling the consuming task
  (or closing the iterator) must abort the work upstream: vLLM ``abort``, the provider's HTTP stream closed.
* ``stats()`` — a cheap :class:`BackendStats` snapshot (no I/O, no awaiting the engine).

In Ray Serve each backend is a deployment whose replicas implement this protocol as methods;
``deployments/`` wraps them, ``cluster/`` implements the logic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest


@runtime_checkable
class Backend(Protocol):
    def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> BackendStats: ...
