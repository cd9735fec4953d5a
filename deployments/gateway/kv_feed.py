"""The gateway's KV-event feed: each live engine replica's events into the backend's routing view.

One background task per self-hosted backend (never per request or chunk). Once a second it asks
Serve for the backend's live replicas (``ReplicaPicker.refresh``: the same list decisions use) and
keeps one follower task per replica that publishes events; a follower long-polls the replica's
``GET /kv_events?after=N&epoch=E&wait=S`` (at most every ``MIN_POLL_S``) and applies each page to the
view in order. Every gateway replica runs its own feed on the same logs, so all of them hold the
same index (see :mod:`cluster.engine.kv_events` for why the gateways pull). A replica whose
connection is refused or cut (its process died) loses its entries at once, before Serve's health
check notices; one Serve drops loses its follower here and its entries in the view at the next
decision, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from cluster.engine.kv_events import FeedCursor, page_from_json
from cluster.routing.view import BackendView
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER

log = logging.getLogger("ray.serve")
REFRESH_S = 1.0  # how often the replica list is re-read
WAIT_S = 2.0  # long-poll wait on an engine replica with nothing new
RETRY_S = 0.5  # after a failed poll
# The shortest time between two polls of one replica. Under load an engine has new events at every
# step, so a long poll answered at once each time made a request per replica per few ms: 14 % of a
# gateway's CPU at 16 vLLM-CPU streams (py-spy). A page then holds up to this long of events. The
# gateway's own sends count in its index at once (``recent_ttl_s``), so only the other gateways'
# sends and the engine's evictions reach it this much later.
MIN_POLL_S = 0.1


class KVEventFeed:
    def __init__(
        self, view: BackendView, picker: Any, session: Callable[[], aiohttp.ClientSession], token: str
    ) -> None:
        self.view, self.picker, self._session, self._token = view, picker, session, token
        self.followers: dict[str, asyncio.Task[None]] = {}
        self.cursors: dict[str, FeedCursor] = {}
        self.errors = 0
        self.lost = 0  # connections to a replica refused or cut (its entries were dropped)
        self.no_events: set[str] = set()  # replicas that answered 404: their engines do not publish

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.picker.refresh()
                    self._follow_live()
                except Exception:  # the feed must outlive a bad moment of Serve's
                    log.exception("KV-event feed of %s: refresh failed", self.view.backend)
                await asyncio.sleep(REFRESH_S)
        finally:
            for t in self.followers.values():
                t.cancel()

    def _follow_live(self) -> None:
        live = self.view.live
        for gone in set(self.followers) - set(live):
            self.followers.pop(gone).cancel()
            self.cursors.pop(gone, None)
        for r, info in live.items():
            if info.kv_events and info.url and r not in self.followers and r not in self.no_events:
                self.cursors[r] = FeedCursor()
                self.followers[r] = asyncio.get_running_loop().create_task(
                    self._follow(r, info.url), name=f"kv-feed-{r}"
                )

    async def _follow(self, replica: str, url: str) -> None:
        cursor = self.cursors[replica]
        headers = {INTERNAL_TOKEN_HEADER: self._token}
        timeout = aiohttp.ClientTimeout(total=WAIT_S + 10)
        clock = time.monotonic
        asked = -MIN_POLL_S
        while True:
            if (pause := asked + MIN_POLL_S - clock()) > 0:
                await asyncio.sleep(pause)
            asked = clock()
            params = {"after": str(cursor.after), "wait": "0"}  # the first ask: at once
            if cursor.epoch is not None:
                params.update(epoch=str(cursor.epoch), wait=str(WAIT_S))
            try:
                async with self._session().get(
                    url + "/kv_events", params=params, headers=headers, timeout=timeout
                ) as resp:
                    if resp.status == 404:
                        self.no_events.add(replica)
                        return
                    resp.raise_for_status()
                    page = page_from_json(await resp.read())
            except asyncio.CancelledError:
                raise
            except aiohttp.ClientConnectionError as exc:
                # Refused or cut: the replica's process is gone or going. Its entries go now, before
                # Serve's health check drops it from the list; if it answers again, its next page
                # starts afresh.
                self.errors += 1
                self.lost += 1
                self.view.replica_lost(replica)
                cursor = self.cursors[replica] = FeedCursor()
                log.debug("KV-event feed of %s: %s", replica, exc)
                await asyncio.sleep(RETRY_S)
                continue
            except Exception as exc:  # slow or garbled: keep what the index holds, ask again
                self.errors += 1
                log.debug("KV-event feed of %s: %s", replica, exc)
                await asyncio.sleep(RETRY_S)
                continue
            self.view.apply_kv_page(replica, page, time.monotonic())  # the clock decisions use
            cursor.advance(page)

    def status(self) -> dict[str, Any]:
        return {
            "followed": sorted(self.followers),
            "errors": self.errors,
            "lost": self.lost,
            "replicas": {
                r: {"after": c.after, "batches": c.batches, "events": c.events, "resets": c.resets}
                for r, c in self.cursors.items()
            },
        }


def kv_index_status(view: BackendView, feed: KVEventFeed | None) -> dict[str, Any]:
    """Operators' and tests' view of the index: per live replica, whether its engine's events feed
    it and the blocks it holds; the feed's cursors."""
    policy = view.policy
    replicas = {}
    if policy is not None:
        for r in view.live:
            replicas[r] = {"event_fed": r in policy.event_fed, "blocks": policy.index.held_blocks(r)}
    return {"replicas": replicas, "feed": feed.status() if feed is not None else None}


def start_feeds(
    views: dict[str, BackendView],
    pickers: dict[str, Any],
    session: Callable[[], aiohttp.ClientSession],
    token: str,
    enabled: dict[str, bool],
) -> tuple[dict[str, KVEventFeed], list[asyncio.Task[None]]]:
    """One feed per backend whose config asks for KV events (``affinity.kv_events``)."""
    feeds = {b: KVEventFeed(v, pickers[b], session, token) for b, v in views.items() if enabled.get(b)}
    loop = asyncio.get_event_loop()
    tasks = [loop.create_task(f.run(), name=f"kv-feed-{b}") for b, f in feeds.items()]
    return feeds, tasks


async def stop_feeds(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
