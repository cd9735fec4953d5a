"""Loopback provider servers for tests: real HTTP on 127.0.0.1, the real wire formats, faults on demand.

In a test::

    with OpenAIServer(api_key="sk-test") as srv:      # or AnthropicServer; .start() / .stop()
        srv.base_url                                  # http://127.0.0.1:<port>/v1
        srv.push_faults("429:2", "stall:3")           # the next requests' faults, in order
        srv.stats().max_in_flight                     # counters, per-request records

As a process: ``python -m tests.servers.openai_server --port 8101`` (``anthropic_server`` alike);
control it over HTTP: ``GET /_control/stats``, ``POST /_control/reset``,
``POST /_control/faults {"faults": [...], "default": "..."}``. Fault specs: :mod:`tests.servers.common`.
"""

from __future__ import annotations

from typing import Any

from tests.servers.common import Fault, LoopbackServer, RequestRecord, ServerStats, parse_fault

__all__ = [
    "AnthropicServer",
    "Fault",
    "LoopbackServer",
    "OpenAIServer",
    "RequestRecord",
    "ServerStats",
    "parse_fault",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``python -m tests.servers.openai_server`` does not import itself twice.
    if name == "OpenAIServer":
        from tests.servers.openai_server import OpenAIServer

        return OpenAIServer
    if name == "AnthropicServer":
        from tests.servers.anthropic_server import AnthropicServer

        return AnthropicServer
    raise AttributeError(name)
