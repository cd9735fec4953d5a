"""The engine an engine replica runs in its own process (vLLM's ``AsyncLLM`` in
``deployments/engine/vllm_replica.py``, the simulator in ``cluster/engine/sim_backend.py``), as the
replica's HTTP shell (``deployments/engine/engine.py``) and its warm-up call it. The gateway never sees it:
it reads an engine replica's HTTP stream, and a provider adapter's chunks, through the one stream
seam of :mod:`cluster.wire.stream`. An engine backend:

* ``generate(req)`` — an async stream of :class:`Chunk` for one :class:`GenerateRequest`; the
  last chunk carries ``finish_reason`` and ``usage``. Failures *before* the first content chunk
  raise a :class:`cluster.wire.errors.ClusterError` whose ``action`` tells the router whether to try
  elsewhere; a failure *after* it raises :class:`StreamInterrupted`. Cancelling the consuming task
  (or closing the iterator) must abort the work upstream (vLLM's ``abort``, the simulator's).
* ``abort(request_id)`` — stop a request's work.
* ``stats()`` — a cheap :class:`BackendStats` snapshot (no I/O, no awaiting the engine).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from cluster.wire.protocol import BackendStats, Chunk, GenerateRequest


@runtime_checkable
class EngineBackend(Protocol):
    """An engine replica's in-process engine (see the module's text)."""

    def generate(self, req: GenerateRequest) -> AsyncGenerator[Chunk, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> BackendStats: ...
