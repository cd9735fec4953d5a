"""The gateway's end of the pushed KV events (:mod:`deployments.engine.kv_pub`): one ZMQ SUB socket
per feed, connected to every engine replica's publisher that the feed follows.

A message is two frames, the replica's id and a page's JSON; it goes to the handler registered
for that replica (:meth:`KVSubscriber.follow`), unparsed. The socket's monitor reports a
connection that closed (the replica's process died: the kernel closed its socket) and ZMQ's
heartbeat one that went silent (its node went away): the handler for losses hears of it at once,
before Serve's health check drops the replica. ZMQ reconnects by itself; the feed asks the log
for what it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from deployments.internal import curve_keys

log = logging.getLogger("ray.serve")
HEARTBEAT_MS = 1000  # ZMQ pings a publisher this often ...
HEARTBEAT_TIMEOUT_MS = 3000  # ... and drops the connection when nothing came back for this long
RCVHWM = 10_000  # pages queued per publisher before ZMQ drops (the feed then asks the log)
DRAIN = 256  # messages taken at once before the event loop gets its turn again


def subscriber_socket(ctx: zmq.asyncio.Context, token: str) -> zmq.asyncio.Socket:
    """A SUB socket to the cluster's CURVE publishers (their key from the internal credential),
    with ZMQ's heartbeat, reconnects and queue bound, subscribed to everything."""
    sock = ctx.socket(zmq.SUB)
    server_public, _ = curve_keys(token)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    for opt, value in (
        (zmq.RCVHWM, RCVHWM),
        (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
        (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        (zmq.RECONNECT_IVL, 100),
        (zmq.RECONNECT_IVL_MAX, 2000),
        (zmq.LINGER, 0),
    ):
        sock.setsockopt(opt, value)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


class KVSubscriber:
    """One SUB socket: ``follow`` a replica's publisher, hear its pages and its losses."""

    def __init__(self, token: str) -> None:
        self._ctx = zmq.asyncio.Context(io_threads=1)
        sock = self._sock = subscriber_socket(self._ctx, token)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._pages: dict[bytes, Callable[[bytes], None]] = {}
        self._losses: dict[str, Callable[[], None]] = {}  # by the publisher's address
        self._addresses: dict[str, str] = {}  # replica -> address
        self.messages = self.unknown = self.disconnects = 0

    def follow(
        self, replica: str, address: str, on_page: Callable[[bytes], None], on_lost: Callable[[], None]
    ) -> None:
        self.unfollow(replica)
        self._pages[replica.encode()] = on_page
        self._losses[address] = on_lost
        self._addresses[replica] = address
        self._sock.connect(address)

    def unfollow(self, replica: str) -> None:
        address = self._addresses.pop(replica, None)
        self._pages.pop(replica.encode(), None)
        if address is not None:
            self._losses.pop(address, None)
            with contextlib.suppress(zmq.ZMQError):  # not connected (any more)
                self._sock.disconnect(address)

    async def run(self) -> None:
        """Hand each page to its replica's handler and each lost connection to its loss handler,
        until cancelled; then the sockets close."""
        try:
            await asyncio.gather(self._receive(), self._watch())
        finally:
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()

    async def _receive(self) -> None:
        """Each message to its handler: the first after a wait awaited, then what else arrived
        meanwhile taken straight off the socket (up to ``DRAIN``), not a future each."""
        now: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)  # the same socket, no futures
        while True:
            self._hand(await self._sock.recv_multipart(copy=True))
            for _ in range(DRAIN):
                try:
                    frames = now.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._hand(frames)

    def _hand(self, frames: list[bytes]) -> None:
        self.messages += 1
        handler = self._pages.get(frames[0]) if len(frames) == 2 else None
        if handler is None:  # a replica no longer followed, or not our shape
            self.unknown += 1
            return
        try:
            handler(frames[1])
        except Exception:  # one bad page must not stop every replica's feed
            log.exception("KV-event feed: a page of %s", frames[0][:64])

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            address = (
                event["endpoint"].decode() if isinstance(event["endpoint"], bytes) else event["endpoint"]
            )
            self.disconnects += 1
            lost = self._losses.get(address)
            if lost is not None:
                lost()

    def status(self) -> dict[str, int]:
        return {
            "following": len(self._addresses),
            "messages": self.messages,
            "unknown": self.unknown,
            "disconnects": self.disconnects,
        }
