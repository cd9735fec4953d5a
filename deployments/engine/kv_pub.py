"""An engine replica's KV events pushed once to every gateway replica (issue 42): a ZMQ PUB socket
on the replica's node address, which every gateway's feed subscribes to
(:mod:`deployments.gateway.kv_feed`).

With the long poll every gateway asked every engine ten times a second, N x M HTTP requests: at 256
engines and 16 gateways half of a gateway's control-plane CPU and most of an engine's went to HTTP
(``loadtest/results/control_plane.json``). Here an engine encodes each page once and hands it to
ZMQ, whose I/O thread (C++, outside the GIL) copies it to each subscriber; a gateway takes one
message per engine page. The log and its ``GET /kv_events`` stay: a gateway asks it once when it
starts following a replica and whenever a pushed page shows it missed one (a new subscriber, a
message dropped at the socket's high-water mark, a feed cut, a restarted engine:
:meth:`cluster.engine.kv_events.FeedCursor.accept`), as vLLM pairs its PUB socket with a replay
socket. A heartbeat page (no batches, the log's head) every ``HEARTBEAT_S`` shows a gateway a
loss that no later page would.

The socket is CURVE-encrypted under a key pair derived from the internal credential
(:func:`deployments.internal.curve_keys`): a subscriber must hold the credential to complete the
handshake, and the events (hashes of prompt blocks) are not readable on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq

from cluster.engine.kv_events import KVEventPage
from deployments.engine.kv_endpoint import KVEventEndpoint
from deployments.internal import curve_keys

log = logging.getLogger("ray.serve")
FLUSH_S = 0.01  # pages pushed at most this often (an engine step's batches go out together)
HEARTBEAT_S = 1.0  # an empty page with the log's head, when nothing else went out
SNDHWM = 1000  # pages queued per subscriber before ZMQ drops (that subscriber then asks the log)


def publisher_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], host: str, token: str
) -> tuple[zmq.Socket[bytes], str]:
    """A CURVE PUB socket (key pair from the internal credential) bound on ``host``, a free port,
    dropping for a subscriber past ``SNDHWM``; and its address."""
    sock = ctx.socket(zmq.PUB)
    public, secret = curve_keys(token)
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.curve_server = True
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    """``endpoint``'s log, pushed: each new batch once, in pages of what was appended since the
    last push (at most every ``flush_s``), the first frame the replica's id (a gateway's one
    socket subscribes to every engine replica), the second the page's JSON (the
    ``GET /kv_events`` answer's). Runs on the replica's event loop."""

    def __init__(
        self,
        endpoint: KVEventEndpoint,
        replica_id: str,
        host: str,
        token: str,
        flush_s: float = FLUSH_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.endpoint, self.flush_s, self.heartbeat_s = endpoint, flush_s, heartbeat_s
        self._topic = replica_id.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._sock, self.address = publisher_socket(self._ctx, host, token)
        self._pushed = endpoint.log.last_seq  # what was appended before anyone could subscribe
        self._epoch = endpoint.log.epoch
        self._due: asyncio.TimerHandle | None = None
        self._last = time.monotonic()  # the last page or heartbeat sent
        self.pages = self.heartbeats = 0
        endpoint.on_append.append(self.appended)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeats(), name="kv-pub-heartbeat")

    def appended(self) -> None:
        """A batch joined the log: push it with whatever else comes within ``flush_s``."""
        if self._due is None:
            self._due = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        """Push the batches appended since the last push (none while a rehearsed cut lasts: the
        gateways find the gap at the next page and ask the log)."""
        self._due = None
        ep = self.endpoint
        if (left := ep.cut_until - time.monotonic()) > 0:
            self._due = asyncio.get_running_loop().call_later(left, self.flush)
            return
        page = ep.log.since(self._pushed, self._epoch)
        self._pushed, self._epoch = page.last_seq, page.epoch
        if page.batches:
            self._send(ep.encoder.encode(page))
            self.pages += 1

    def _send(self, body: bytes) -> None:
        self._last = time.monotonic()
        with contextlib.suppress(zmq.Again):  # a PUB socket drops rather than blocks; never raises
            self._sock.send_multipart([self._topic, body], flags=zmq.NOBLOCK)

    async def _heartbeats(self) -> None:
        """The log's head, when nothing went out for ``heartbeat_s``: a gateway that lost the last
        page sees that it is behind."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if self._due is None and self.endpoint.cut_until <= now and now - self._last >= self.heartbeat_s:
                self._send(self.endpoint.encoder.encode(KVEventPage(self._epoch, [], self._pushed)))
                self.heartbeats += 1

    def close(self) -> None:
        self._beat.cancel()
        if self._due is not None:
            self._due.cancel()
        with contextlib.suppress(ValueError):
            self.endpoint.on_append.remove(self.appended)
        self._sock.close(linger=0)
        self._ctx.term()

    def status(self) -> dict[str, int | str]:
        return {
            "address": self.address,
            "pushed": self._pushed,
            "pages": self.pages,
            "heartbeats": self.heartbeats,
        }
