"""Engines announce only anchors (issue 42): the replica publishes its stores, evictions and
``BlocksQueued`` strided to ``affinity.claim_stride_blocks`` (every k-th block of a chain and its
last, cluster/routing/event_hashes.py), the gateways apply k times fewer hashes and their index
holds anchors, a match known to within k blocks; homes, sessions and block counts as before."""

from __future__ import annotations

import json
import random

from cluster.engine.kv_events import (
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    FeedCursor,
    IndexRemoved,
    IndexStored,
    KVEventBatch,
    KVEventLog,
    KVEventPage,
    page_from_json,
    page_to_wire,
)
from cluster.engine.model import EngineModel
from cluster.engine.profiles import TINY_LLAMA, EngineSpec, FittedCoefficients, Profile
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.block_hash import BlockHasher, strided
from cluster.routing.event_hashes import RouterHashes
from cluster.routing.prefix_index import PrefixIndex
from cluster.routing.view import BackendView, ReplicaInfo

BS, K = 4, 3


def _tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(5, 2000) for _ in range(n)]


def test_the_replica_publishes_its_chains_anchors_and_what_they_stand_for():
    hasher = BlockHasher(BS, "m")
    rh = RouterHashes(hasher, stride=K)
    toks = _tokens(1, 10 * BS)
    full = hasher.hash_blocks(toks)
    depth = {h: i + 1 for i, h in enumerate(full)}
    out = rh.translate(
        [BlockStored([1, 2, 3, 4], None, toks[:16], BS), BlockStored([5, 6, 7, 8, 9, 10], 4, toks[16:], BS)]
    )
    assert all(isinstance(e, IndexStored) and e.stride == K for e in out)
    # depths 3 and 6, 9 (every K-th of the chain, across the two events) and each event's last, in
    # one event for the step (coalesced: event_hashes.coalesce)
    assert [[depth[h] for h in e.block_hashes] for e in out] == [[3, 4, 6, 9, 10]]
    assert [e.blocks for e in out if isinstance(e, IndexStored)] == [10]
    queued = rh.translate([BlocksQueued(full, "s")])
    assert queued == [BlocksQueued(strided(full, K), "s", K)]
    gone = rh.translate([BlockRemoved([9, 10, 11])])  # 11: never stored, not counted
    assert gone == [IndexRemoved([full[8], full[9]], 2)]
    assert rh.translate([BlockRemoved([1, 2])]) == [IndexRemoved([], 2)]  # no anchor, still counted
    one = RouterHashes(hasher).translate([BlockStored([1, 2], None, toks[:8], BS), BlocksQueued(full)])
    assert one == [IndexStored(full[:2]), BlocksQueued(full)]  # stride 1: every block, as before


def test_the_wire_carries_stride_and_blocks_and_is_unchanged_without_them():
    log = KVEventLog(epoch=2)
    log.append([IndexStored([1, 2], 8, 11), IndexRemoved([3], 9), BlocksQueued([4], "s", 8)], 1.0)
    log.append([IndexStored([5]), IndexRemoved([6]), BlocksQueued([7], None)], 2.0)
    page = log.since(0)
    body = json.dumps(page_to_wire(page))
    assert page_from_json(body).batches == page.batches
    assert "stride" not in json.dumps(page_to_wire(log.since(1))) and "blocks" not in body.split("]}, ")[-1]


def test_an_anchored_index_matches_at_anchors_and_the_prompts_last_block():
    idx = PrefixIndex(1000, stride=4)
    chain = list(range(100, 110))  # 10 blocks: anchors at 4, 8 and 10
    idx.record("a", strided(chain, 4), blocks=10)
    assert idx.held_blocks("a") == 10 and len(idx) == 3
    bit = idx.bit("a")
    assert idx.longest_match(chain, -1) == (10, bit)
    assert idx.longest_match([*chain[:9], 7, 8], -1)[0] == 8  # diverges at 10: known to within 4
    assert idx.longest_match([*chain[:3], 7], -1) == (0, 0)
    idx.on_block_removed("a", [chain[9]], 2)  # blocks 9 and 10 evicted: anchor 10 goes
    assert idx.longest_match(chain, -1)[0] == 8 and idx.held_blocks("a") == 8


def _profile(kv_blocks: int) -> Profile:
    return Profile(
        name="test",
        model=TINY_LLAMA,
        fitted=FittedCoefficients(prefill_s_per_token=1e-4, decode_base_s=1e-3, decode_s_per_seq=2e-4),
        engine=EngineSpec(
            block_size=BS,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=64,
            kv_cache_bytes=kv_blocks * BS * TINY_LLAMA.kv_bytes_per_token(),
            step_overhead_s=5e-4,
        ),
    )


class _Fleet:
    """Two sim replicas whose servers translate with ``stride``, and one gateway following them."""

    def __init__(self, stride: int) -> None:
        self.logs = {n: KVEventLog(epoch=1) for n in "ab"}
        self.engines = {}
        for n, log in self.logs.items():
            log.translate = RouterHashes(BlockHasher(BS, "m"), stride=stride).translate
            self.engines[n] = EngineModel(
                _profile(24), on_kv_events=lambda ev, end, log=log: log.append(ev, end)
            )
        params = AffinityParams(min_match_tokens=8, new_prefix="home", claim_stride_blocks=K)
        self.view = BackendView("b", AffinityRouter(BS, "m", params), ReplicaEjector(), 64)
        self.view.sync([ReplicaInfo(n, f"http://{n}", kv_events=True, kv_blocks=24) for n in "ab"])
        self.cursors = {n: FeedCursor() for n in "ab"}
        self.hashes_sent = 0
        self.served = 0

    def serve(self, name: str, tokens: list[int], session: str) -> None:
        hashes = self.view.policy.hash(tokens)  # the replica announces it, then computes it
        self.logs[name].append([BlocksQueued(hashes, session)], 0.0)
        self.served += 1
        self.engines[name].add_request(f"{name}-{self.served}", tokens, 2)
        self.engines[name].run()

    def poll(self, now: float) -> None:
        for n, log in self.logs.items():
            c = self.cursors[n]
            page: KVEventPage = page_from_json(json.dumps(page_to_wire(log.since(c.after, c.epoch))))
            self.hashes_sent += sum(
                len(getattr(e, "block_hashes", ())) for b in page.batches for e in b.events
            )
            self.view.apply_kv_page(n, page, now)
            c.advance(page)


def test_a_gateway_fed_anchors_decides_as_one_fed_every_block():
    """The same engines' events, published whole and as anchors: the anchored gateway receives
    fewer hashes, holds the same homes, sessions and block counts, and makes the same choices,
    its matches at most K - 1 blocks short."""
    whole, anchored = _Fleet(1), _Fleet(K)
    prompts = [_tokens(s, 4 * 13) for s in range(4)]
    turns = [("a" if s % 2 else "b", p, f"s{s}") for s, p in enumerate(prompts)]
    turns += [("a", prompts[0][:40] + _tokens(9, 12), "s0")]  # a shorter turn sharing 10 blocks
    for name, p, sid in turns + turns[:2]:  # the caches (24 blocks) evict
        for fleet in (whole, anchored):
            fleet.serve(name, p, sid)
            fleet.poll(1.0)
    pw, pa = whole.view.policy, anchored.view.policy
    assert anchored.hashes_sent * 2 < whole.hashes_sent
    assert list(pa.homes._home.items()) == list(pw.homes._home.items()) and len(pa.homes) > 0
    assert [pa.index.held_blocks(n) for n in "ab"] == [pw.index.held_blocks(n) for n in "ab"]
    assert pa.sessions.get("s1", 1.0) == pw.sessions.get("s1", 1.0) == "a"
    for p in [*prompts, prompts[0][:44]]:
        dw, da = whole.view.choose(pw.hash(p), 9.0), anchored.view.choose(pa.hash(p), 9.0)
        assert dw is not None and da is not None and da.replica == dw.replica
        assert da.decision.reason == dw.decision.reason
        assert dw.decision.matched_blocks - K < da.decision.matched_blocks <= dw.decision.matched_blocks


def test_announcements_in_another_stride_are_counted_and_left_out_of_homes():
    policy = AffinityRouter(BS, "m", AffinityParams(new_prefix="home", claim_stride_blocks=K))
    page = KVEventPage(1, [], 0)
    policy.apply_kv_page("a", page, 0.0)
    batch = [BlocksQueued([1, 2, 3], "s", K + 1)]
    policy.apply_kv_page("a", KVEventPage(1, [KVEventBatch(1, 0.0, tuple(batch))], 1), 0.0)
    assert policy.kv_mismatched == 1 and len(policy.homes) == 0 and not policy.index._recent
    assert policy.sessions.get("s", 0.0) == "a"  # the session still moved there
