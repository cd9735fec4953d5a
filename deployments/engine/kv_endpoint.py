"""An engine replica's side of the KV-event transport (:mod:`cluster.engine.kv_events`): its log served as
``GET /kv_events?after=N&epoch=E&wait=S`` (a long poll, the internal credential required), and the
``BlocksQueued`` it publishes as each request arrives. The gateways' side is
:mod:`deployments.gateway.kv_feed`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from aiohttp import web

from cluster.engine.kv_events import BlocksQueued, KVEventLog, PageEncoder
from cluster.routing.block_hash import BlockHasher
from cluster.routing.event_hashes import RouterHashes
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER
from cluster.wire.errors import InvalidRequest, to_wire
from cluster.wire.protocol import GenerateRequest
from deployments.internal import token_ok

MAX_WAIT_S = 30.0
MAX_CUT_S = 300.0  # the longest rehearsed feed cut


class KVEventEndpoint:
    """``log``'s HTTP face. ``hasher``: the gateways' block hash of this backend (same block size
    and model), for the ``BlocksQueued`` announcements and the stores and evictions, which the log
    keeps in the router's hashes (``IndexStored``/``IndexRemoved``): hashed once here, not on every
    gateway replica (:mod:`cluster.routing.event_hashes`). ``stride``: the backend's
    ``affinity.claim_stride_blocks``: only the anchors the gateways look up are published."""

    def __init__(self, log: KVEventLog, token: str, hasher: BlockHasher, stride: int = 1) -> None:
        self.log, self._token, self.hasher = log, token, hasher
        self._new = asyncio.Event()
        self.on_append: list[Callable[[], None]] = []  # told of each batch too (the publisher)
        log.on_append = self._appended  # appended on this loop (vLLM's thread hands over to it)
        self.router_hashes = RouterHashes(hasher, stride=stride)
        log.translate = self.router_hashes.translate
        self.encoder = PageEncoder()  # each batch's JSON made once, for every gateway that asks
        self.cut_until = 0.0  # a rehearsed feed cut (``fault``): polls stall until then

    def _appended(self) -> None:
        self._new.set()
        for fn in self.on_append:
            fn()

    def announce(self, req: GenerateRequest) -> None:
        """A request arrived: every gateway learns where its prompt's blocks are going (and its
        session) before the engine computes them."""
        hashes = self.hasher.hash_blocks(req.prompt_token_ids, salt=req.cache_salt)  # as the gateway's
        queued = BlocksQueued(hashes, req.session_id)
        self.log.append([queued], time.time())

    async def handle(self, request: web.Request) -> web.Response:
        """The batches after ``after``; with none, waits up to ``wait`` seconds for the next one."""
        if not token_ok(request.headers.get(INTERNAL_TOKEN_HEADER), self._token):
            return web.json_response({"error": to_wire(InvalidRequest("forbidden"))}, status=403)
        q = request.query
        try:
            after = int(q.get("after", "0"))
            epoch = int(q["epoch"]) if "epoch" in q else None
            wait = min(max(float(q.get("wait", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            err = InvalidRequest("after, epoch and wait must be numbers", param="after")
            return web.json_response({"error": to_wire(err)}, status=400)
        if (left := self.cut_until - time.monotonic()) > 0:
            await asyncio.sleep(left)  # unreachable: the poller times out, as behind a dropped route
        page = self.log.since(after, epoch)
        if not page.batches and not page.reset and wait > 0:
            self._new.clear()  # no await since the since() above: no batch can slip between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), wait)
            page = self.log.since(after, epoch)
        return web.Response(body=self.encoder.encode(page), content_type="application/json")

    async def fault(self, request: web.Request) -> web.Response:
        """``POST /kv_events/fault {"cut_s": S}`` (the internal credential required): for ``S``
        seconds every poll of this log stalls, unanswered, as if the event endpoint were
        unreachable, while the engine keeps serving (the production rehearsal's KV-event feed cut;
        ``S`` = 0 ends a cut). Answers the log's head, for a reader to see the gateways catch up."""
        if not token_ok(request.headers.get(INTERNAL_TOKEN_HEADER), self._token):
            return web.json_response({"error": to_wire(InvalidRequest("forbidden"))}, status=403)
        try:
            cut_s = float((await request.json())["cut_s"])
            if not 0 <= cut_s <= MAX_CUT_S:
                raise ValueError(cut_s)
        except (ValueError, KeyError, TypeError):
            err = InvalidRequest(f"cut_s must be a number of seconds in [0, {MAX_CUT_S:g}]", param="cut_s")
            return web.json_response({"error": to_wire(err)}, status=400)
        self.cut_until = time.monotonic() + cut_s
        return web.json_response({"cut_s": cut_s, "epoch": self.log.epoch, "last_seq": self.log.last_seq})


async def no_events(request: web.Request) -> web.Response:
    """The answer of a replica whose engine publishes no KV events: the gateways stop asking."""
    return web.json_response(
        {"error": to_wire(InvalidRequest("this engine publishes no KV events"))}, status=404
    )
