"""A backend's KV indexer (``affinity.kv_index: indexer``, issue 42): the engines' KV events applied
once, their changes published to every gateway replica.

One Serve deployment per shard (``indexer-<backend>-<shard>``, one replica each; ``indexer_shards``
of them share the anchors by ``h % shards``). A replica follows the backend's engine replicas as
a gateway did (the same :class:`deployments.gateway.kv_feed.KVEventFeed`: Serve's replica list,
each replica's pushed pages, its log after a miss) into a
:class:`cluster.routing.index_mirror.FrameBuilder`, and every ``FLUSH_S`` publishes the frame of
what changed on a ZMQ PUB socket on its node address (CURVE-encrypted under the internal
credential's key, as the engines' publishers are): one message per frame to every gateway,
whatever the fleet. A frame says its indexer's run (``epoch``) and number; with nothing new, a
heartbeat (the last number again) every ``HEARTBEAT_S``. A gateway that starts, or sees a gap or
a new run, asks :meth:`KVIndexer.snapshot` (:mod:`deployments.gateway.index_sub`).

When an indexer's replica dies, Serve starts another (a new run: the gateways take its snapshot);
meanwhile the gateways route on the index as it last was plus their own sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import aiohttp
import zmq
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import BackendConfig
from cluster.engine.kv_events import KVEventPage
from cluster.json_types import JSONObject
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.index_mirror import FrameBuilder, IndexFrame, encode_frame
from cluster.routing.view import BackendView
from deployments.engine.engine import node_host
from deployments.engine.kv_pub import FLUSH_S, HEARTBEAT_S, publisher_socket
from deployments.gateway.engine_client import TYPICAL_START_S, ReplicaPicker, block_size
from deployments.gateway.kv_feed import KVEventFeed
from deployments.internal import internal_token

log = logging.getLogger("ray.serve")


class FramePublisher:
    """The indexer's PUB socket: each frame once, ZMQ's I/O thread copies it to every gateway.
    Two message frames: the topic (``<backend>/<shard>``) and the frame's bytes."""

    def __init__(self, topic: str, host: str, token: str) -> None:
        self._topic = topic.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._sock, self.address = publisher_socket(self._ctx, host, token)
        self.sent = 0

    def send(self, body: bytes) -> None:
        with contextlib.suppress(zmq.Again):  # a PUB socket drops rather than blocks (the gap is seen)
            self._sock.send_multipart([self._topic, body], flags=zmq.NOBLOCK)
        self.sent += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


@serve.deployment(max_ongoing_requests=64, health_check_period_s=2)
class KVIndexer:
    def __init__(
        self, backend: JSONObject, engines: DeploymentHandle, shard: int = 0, shards: int = 1
    ) -> None:
        b = BackendConfig.model_validate(backend)
        self._token = internal_token()
        policy = AffinityRouter(block_size(b), b.model, AffinityParams(**b.affinity.params()))
        self.view = BackendView(b.name, policy, ReplicaEjector(), b.max_in_flight_per_replica, b.routing)
        self.builder = FrameBuilder(policy, shard, shards)
        self.epoch = random.getrandbits(62) + 1
        self._wide = policy.hasher.algo != "tuple"  # blake2b hashes are unsigned
        self._session: aiohttp.ClientSession | None = None
        picker = ReplicaPicker(engines, self.view, TYPICAL_START_S.get(b.kind, 30.0))
        self.feed = KVEventFeed(self.view, picker, self._client_session, self._token, sink=self._take)
        self.pub = FramePublisher(f"{b.name}/{shard}", node_host(), self._token)
        loop = asyncio.get_event_loop()
        self._tasks = [
            loop.create_task(self.feed.run(), name=f"indexer-feed-{b.name}"),
            loop.create_task(self._publish(), name=f"indexer-pub-{b.name}"),
        ]
        self.frames = self.heartbeats = self.snapshots = 0
        log.info("KV indexer %s shard %d/%d publishes on %s", b.name, shard, shards, self.pub.address)

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def _take(self, replica: str, page: KVEventPage, now: float) -> None:
        """A replica's page from the feed: a late page of a replica Serve dropped is not taken."""
        if replica in self.view.live:
            self.builder.take(replica, page, now)

    def _frame_bytes(self, frame: IndexFrame) -> bytes:
        frame.epoch = self.epoch
        return encode_frame(frame, self._wide)

    async def _publish(self) -> None:
        """Every ``FLUSH_S``: the frame of what changed, or a heartbeat when none went for a while."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_S)
            now = time.monotonic()
            try:
                frame = self.builder.flush(now)
            except Exception:  # a bug here must not stop the index; the gateways resync on the gap
                log.exception("KV indexer: a frame failed")
                continue
            if frame is not None:
                self.pub.send(self._frame_bytes(frame))
                self.frames, last = self.frames + 1, now
            elif now - last >= HEARTBEAT_S:
                b = self.builder
                self.pub.send(self._frame_bytes(IndexFrame(b.seq, shard=b.shard, shards=b.shards)))
                self.heartbeats, last = self.heartbeats + 1, now

    async def address(self) -> str:
        """Where the frames are published (a gateway's subscriber connects there)."""
        return self.pub.address

    async def snapshot(self) -> bytes:
        """What the gateways hold as of the last frame (its number), for a gateway that starts or
        missed one (:meth:`FrameBuilder.snapshot`)."""
        self.snapshots += 1
        return self._frame_bytes(self.builder.snapshot())

    async def status(self) -> JSONObject:
        b = self.builder
        return {
            "address": self.pub.address,
            "epoch": self.epoch,
            "seq": b.seq,
            "shard": b.shard,
            "shards": b.shards,
            "pages": b.pages,
            "frames": self.frames,
            "heartbeats": self.heartbeats,
            "snapshots": self.snapshots,
            "anchors": len(b.router.index),
            "feed": self.feed.status(),
        }

    async def __del__(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._session is not None:
            await self._session.close()
        with contextlib.suppress(Exception):
            self.pub.close()
