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

from tests.servers.anthropic_server import AnthropicServer
from tests.servers.common import Fault, LoopbackServer, RequestRecord, ServerStats, parse_fault
from tests.servers.openai_server import OpenAIServer

__all__ = [
    "AnthropicServer",
    "Fault",
    "LoopbackServer",
    "OpenAIServer",
    "RequestRecord",
    "ServerStats",
    "parse_fault",
]
