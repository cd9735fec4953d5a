"""An engine attempt whose connection is lost before any answer (the replica's process died: its
socket closes or resets, as when a node is lost with the gateway's pooled connections to it) picks
another replica within the same attempt, as for a refused connection: the client got nothing from
it. Real sockets on loopback: one server closes each connection once the request arrives, one
resets it (SO_LINGER 0), then an aiohttp server streams."""

from __future__ import annotations

import asyncio
import socket
import struct

from tests.unit.test_engine_repick import EVENT, _choices, _run, _serve, _streams


async def _dies_on_request(reset: bool) -> tuple[asyncio.Server, str]:
    """A 'replica' that reads the request's first bytes and dies: a close, or a reset."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort() if reset else writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_a_connection_closed_or_reset_before_any_answer_is_skipped_for_a_replica_that_streams() -> None:
    async def main() -> None:
        closes, closes_url = await _dies_on_request(reset=False)
        resets, resets_url = await _dies_on_request(reset=True)
        ok, ok_url = await _serve(_streams)
        try:
            skipped: list[str] = []
            out = await _run(_choices(closes_url, resets_url, ok_url), skipped)
            assert b"".join(out) == EVENT
            assert skipped == [closes_url, resets_url]
        finally:
            closes.close()
            resets.close()
            await ok.cleanup()

    asyncio.run(main())
