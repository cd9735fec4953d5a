"""A gateway's mirror of a backend's KV indexers (``affinity.kv_index: indexer``, issue 42): one ZMQ
SUB socket to their publishers (:mod:`deployments.indexer.indexer`), each shard's frames applied to
the backend's routing view in order (:class:`cluster.routing.index_mirror.ShardCursor`).

The first frame heard from a shard, a new run of it (its replica restarted) or a missed frame
makes the follower ask that shard's snapshot (a Serve call) while later frames wait; then it goes
on from the snapshot's number. A shard silent for ``SILENT_S`` (no frame, no heartbeat) has its
address asked again: Serve may have started its replacement elsewhere. Meanwhile decisions use the
mirror as it last was, and this gateway's own sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio
from ray.serve.handle import DeploymentHandle

from cluster.json_types import JSONObject
from cluster.routing.index_mirror import IndexFrame, ShardCursor, decode_frame
from cluster.routing.view import BackendView
from deployments.gateway.kv_sub import subscriber_socket

log = logging.getLogger("ray.serve")
SILENT_S = 3.0  # a shard heard nothing from this long: its address asked again
ASK_TIMEOUT_S = 10.0  # a Serve call to an indexer (its address, its snapshot)
RETRY_S = 0.5


class IndexFollower:
    def __init__(self, view: BackendView, indexers: list[DeploymentHandle], token: str) -> None:
        self.view, self.handles, self._token = view, indexers, token
        self.cursors = [ShardCursor() for _ in indexers]
        self._waiting: list[list[IndexFrame] | None] = [None] * len(indexers)  # frames held during a sync
        self.addresses: list[str | None] = [None] * len(indexers)
        self._heard = [0.0] * len(indexers)
        self._syncs: set[asyncio.Task[None]] = set()
        self.frames = self.snapshots = self.gaps = self.errors = 0

    async def run(self) -> None:
        ctx = zmq.asyncio.Context(io_threads=1)
        sock = subscriber_socket(ctx, self._token)
        try:
            await asyncio.gather(self._receive(sock), self._watch(sock))
        finally:
            for t in self._syncs:
                t.cancel()
            sock.close(linger=0)
            ctx.term()

    async def _watch(self, sock: zmq.asyncio.Socket) -> None:
        """Each shard's address, asked at the start and whenever the shard went silent."""
        while True:
            for s, handle in enumerate(self.handles):
                if self.addresses[s] is not None and time.monotonic() - self._heard[s] < SILENT_S:
                    continue
                try:
                    address = await asyncio.wait_for(handle.address.remote(), ASK_TIMEOUT_S)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # not up yet, or restarting: asked again next round
                    self.errors += 1
                    log.debug("index feed of %s: shard %d's address: %s", self.view.backend, s, exc)
                    continue
                old, self.addresses[s], self._heard[s] = self.addresses[s], address, time.monotonic()
                if old != address:
                    if old is not None:
                        with contextlib.suppress(zmq.ZMQError):
                            sock.disconnect(old)
                    sock.connect(address)
            await asyncio.sleep(1.0)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            parts = await sock.recv_multipart()
            try:
                frame = decode_frame(parts[-1])
            except ValueError as exc:
                self.errors += 1
                log.debug("index feed of %s: %s", self.view.backend, exc)
                continue
            if not 0 <= frame.shard < len(self.handles):
                self.errors += 1
                continue
            self._heard[frame.shard] = time.monotonic()
            self._on(frame)

    def _on(self, frame: IndexFrame) -> None:
        s = frame.shard
        waiting = self._waiting[s]
        if waiting is not None:
            waiting.append(frame)
            return
        verdict = self.cursors[s].accept(frame)
        if verdict == "apply":
            self.view.apply_index_frame(frame, time.monotonic())
            self.cursors[s].advance(frame)
            self.frames += 1
        elif verdict == "gap":
            self.gaps += 1
            self._waiting[s] = [frame]
            task = asyncio.get_running_loop().create_task(self._sync(s), name=f"index-sync-{s}")
            self._syncs.add(task)
            task.add_done_callback(self._syncs.discard)

    async def _sync(self, s: int) -> None:
        """The shard's snapshot applied, then the frames that came meanwhile (from its number on)."""
        while True:
            try:
                body = await asyncio.wait_for(self.handles[s].snapshot.remote(), ASK_TIMEOUT_S)
                snap = decode_frame(body)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors += 1
                log.debug("index feed of %s: shard %d's snapshot: %s", self.view.backend, s, exc)
                await asyncio.sleep(RETRY_S)
        self.view.apply_index_frame(snap, time.monotonic())
        self.cursors[s].advance(snap)
        self.snapshots += 1
        held, self._waiting[s] = self._waiting[s] or [], None
        for frame in held:
            self._on(frame)

    def status(self) -> JSONObject:
        return {
            "indexers": [
                {"address": a, "epoch": c.epoch, "seq": c.seq, "syncing": w is not None}
                for a, c, w in zip(self.addresses, self.cursors, self._waiting, strict=True)
            ],
            "frames": self.frames,
            "snapshots": self.snapshots,
            "gaps": self.gaps,
            "errors": self.errors,
        }


def start_followers(
    views: dict[str, BackendView], indexers: dict[str, list[DeploymentHandle]], token: str
) -> tuple[dict[str, IndexFollower], list[asyncio.Task[None]]]:
    """One follower per backend whose KV events its indexers apply."""
    followers = {b: IndexFollower(views[b], hs, token) for b, hs in indexers.items() if b in views and hs}
    loop = asyncio.get_event_loop()
    tasks = [loop.create_task(f.run(), name=f"index-feed-{b}") for b, f in followers.items()]
    return followers, tasks
