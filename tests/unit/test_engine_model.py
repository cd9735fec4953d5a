"""The simulated engine on its virtual clock: exact timings from a linear step-time model, the
prefix cache's hashing, hits and LRU eviction, chunked prefill, preemption, waiting."""

from __future__ import annotations

import random
import time

import pytest

from cluster.engine.kv import BlockPool, KVCacheManager, hash_block_tokens, hash_request_tokens
from cluster.engine.model import EngineModel, Status, fake_token_id
from cluster.engine.profiles import FittedCoefficients, Profile, get_profile
from tests.unit.engine_profiles import linear_profile

PREFILL = 1e-3  # s per prefill token
DECODE_BASE = 10e-3  # s per step with decodes
PER_SEQ = 1e-3  # s per decoding sequence
OVERHEAD = 2e-3  # s per step


def make_profile(**engine: int) -> Profile:
    """The test profile on an engine of ``engine``'s size (``engine_profiles.ENGINE``'s keys)."""
    fitted = FittedCoefficients(
        prefill_s_per_token=PREFILL, decode_base_s=DECODE_BASE, decode_s_per_seq=PER_SEQ
    )
    return linear_profile(fitted, OVERHEAD, **engine)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- hashing and the block pool ------------------------------------------------------------


def test_block_hashes_chain_over_the_prefix_and_skip_partial_blocks() -> None:
    a = hash_request_tokens(toks(0, 10), 4)
    assert len(a) == 2  # the 2-token tail is not a full block
    assert a[0] == hash_block_tokens(None, toks(0, 4))
    assert a[1] == hash_block_tokens(a[0], toks(4, 4))
    # Same second block after a different first block: different hash (the chain).
    b = hash_request_tokens([99, 1, 2, 3, *toks(4, 4)], 4)
    assert b[1] != a[1]
    # Extra keys (e.g. a LoRA or cache salt) separate otherwise equal prefixes.
    assert hash_request_tokens(toks(0, 4), 4, ("salt",)) != hash_request_tokens(toks(0, 4), 4)
    # Incremental hashing extends what is there.
    part = hash_request_tokens(toks(0, 5), 4)
    assert hash_request_tokens(toks(0, 12), 4, hashes=part) == hash_request_tokens(toks(0, 12), 4)


def test_block_pool_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache(b, h)
    assert pool.num_free == 0 and pool.usage() == 1.0
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.free_queue() == [2, 0, 3, 1]
    assert pool.lookup(hashes) == blocks  # freed blocks stay findable

    (got,) = pool.allocate(1)
    assert got is blocks[2] and pool.cached(hashes[2]) is None and pool.evictions == 1
    # A hit takes block 0 off the queue; freed again, it is the most recent.
    pool.touch([blocks[0]])
    assert pool.free_queue() == [3, 1]
    pool.free([blocks[0]])
    assert pool.free_queue() == [3, 1, 0]
    assert pool.allocate(2) == [blocks[3], blocks[1]]
    assert pool.cached(hashes[0]) is blocks[0]
    assert pool.lookup(hashes) == [blocks[0]]  # the run stops at the first evicted hash


def test_kv_manager_refuses_what_does_not_fit_and_counts_evictable_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 8)
    hs = hash_request_tokens(toks(0, 8), 4)
    kv.cache_blocks("a", hs, 8)
    kv.free("a")
    hits = kv.computed_blocks([*hs, b"x"], 13)
    assert len(hits) == 2
    # 13 tokens = 4 blocks: 2 hits (both free, so they leave the free queue) + 2 new = all 4.
    assert kv.allocate_slots("b", 13, hits)
    assert kv.pool.num_free == 0
    assert not kv.allocate_slots("c", 1)
    kv.free("b")
    assert kv.pool.num_free == 4


# --- timings ---------------------------------------------------------------------------------


def test_ttft_grows_with_uncached_prompt_and_falls_when_the_prefix_is_cached() -> None:
    e = EngineModel(make_profile())
    r1 = e.add_request("r1", toks(0, 40), 1)
    e.run()
    assert r1.ttft == pytest.approx(OVERHEAD + 40 * PREFILL)
    r2 = e.add_request("r2", toks(1000, 20), 1)
    e.run()
    assert r2.ttft == pytest.approx(OVERHEAD + 20 * PREFILL)
    # Same 40-token prompt again: 9 blocks (36 tokens) hit, at most 39 could; 4 are computed.
    r3 = e.add_request("r3", toks(0, 40), 1)
    e.run()
    assert r3.num_cached_tokens == 36
    assert r3.ttft == pytest.approx(OVERHEAD + 4 * PREFILL)
    # A shared 24-token prefix, then 16 new tokens: 6 blocks hit.
    r4 = e.add_request("r4", [*toks(0, 24), *toks(500, 16)], 1)
    e.run()
    assert r4.num_cached_tokens == 24
    assert r4.ttft == pytest.approx(OVERHEAD + 16 * PREFILL)


def test_prefix_caching_off_never_hits() -> None:
    e = EngineModel(make_profile(), enable_prefix_caching=False)
    e.add_request("a", toks(0, 40), 1)
    e.run()
    b = e.add_request("b", toks(0, 40), 1)
    e.run()
    assert b.num_cached_tokens == 0 and e.counters.prefix_cache_hits == 0
    assert b.ttft == pytest.approx(OVERHEAD + 40 * PREFILL)


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    e = EngineModel(make_profile(budget=16))
    r = e.add_request("r", toks(0, 40), 1)
    e.run()
    assert e.counters.steps == 3  # 16 + 16 + 8
    assert r.ttft == pytest.approx(3 * OVERHEAD + 40 * PREFILL)


def test_inter_token_latency_grows_with_batch_size() -> None:
    itl = {}
    for n in (1, 4, 8):
        e = EngineModel(make_profile())
        reqs = [e.add_request(f"r{i}", toks(100 * i, 8), 5) for i in range(n)]
        e.run()
        gaps = {round(g, 9) for r in reqs for g in r.inter_token_latencies()}
        assert gaps == {round(OVERHEAD + DECODE_BASE + n * PER_SEQ, 9)}
        itl[n] = gaps.pop()
    assert itl[1] < itl[4] < itl[8]
    # The roofline profile too: more sequences, more KV to read per step.
    physics = {}
    for n in (1, 64):
        e = EngineModel(get_profile("llama-3.1-8b-h100"))
        reqs = [e.add_request(f"r{i}", toks(10_000 * i, 2000), 4) for i in range(n)]
        e.run()
        physics[n] = reqs[0].inter_token_latencies()[-1]
    assert physics[64] > physics[1]


def test_decodes_go_first_then_prefill_chunks_fill_the_budget() -> None:
    e = EngineModel(make_profile(budget=16))
    a = e.add_request("a", toks(0, 8), 10)
    e.step()  # a's prefill
    assert a.is_decoding
    e.add_request("b", toks(100, 40), 1)
    res = e.step()
    assert res is not None
    assert res.batch.decode_tokens == 1 and res.batch.prefill_tokens == 15
    assert res.duration == pytest.approx(OVERHEAD + 15 * PREFILL + DECODE_BASE + PER_SEQ)


def test_run_until_runs_steps_that_start_before_t_and_jumps_over_idle_time() -> None:
    e = EngineModel(make_profile())
    r = e.add_request("r", toks(0, 8), 3, arrival_time=5.0)
    assert e.run_until(1.0) == 0 and e.now == 1.0 and r.status is Status.PENDING
    assert e.run_until(5.001) == 1  # the prefill step starts at 5.0 and ends after 5.001
    assert r.first_token_time == pytest.approx(5.0 + OVERHEAD + 8 * PREFILL)
    e.run()
    assert r.finish_reason == "length" and r.num_output_tokens == 3
    assert len(r.token_times) == 3 and r.finish_time == r.token_times[-1]
    e.run_until(100.0)
    assert e.now == 100.0


def test_max_model_len_ends_generation() -> None:
    e = EngineModel(make_profile(max_model_len=16))
    r = e.add_request("r", toks(0, 12), 100)
    e.run()
    assert r.finish_reason == "length" and r.num_tokens == 16 and r.num_output_tokens == 4
    with pytest.raises(ValueError, match="no room"):
        e.add_request("big", toks(0, 16), 1)
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request("x", [1], 1)
        e.add_request("x", [1], 1)


def test_cache_that_cannot_hold_max_model_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        EngineModel(make_profile(num_blocks=4, max_model_len=64))


def test_stop_after_ends_with_stop() -> None:
    e = EngineModel(make_profile())
    r = e.add_request("r", toks(0, 8), 10, stop_after=3)
    e.run()
    assert r.finish_reason == "stop" and r.num_output_tokens == 3


# --- memory pressure ------------------------------------------------------------------------


def test_a_request_that_does_not_fit_waits_for_memory() -> None:
    e = EngineModel(make_profile(num_blocks=8, max_model_len=32))
    a = e.add_request("a", toks(0, 20), 4)  # up to 23 computed tokens: 6 blocks
    b = e.add_request("b", toks(100, 20), 4, arrival_time=0.001)  # 5 blocks: only 3 left
    e.run()
    assert a.num_preemptions == b.num_preemptions == 0 and e.counters.preemptions == 0
    assert a.finish_time is not None and b.first_scheduled_time is not None
    assert b.first_scheduled_time >= a.finish_time
    assert e.kv.pool.num_free == 8


def test_kv_exhaustion_preempts_the_newest_and_recomputes_identically() -> None:
    e = EngineModel(make_profile(num_blocks=8, max_model_len=32))
    a = e.add_request("a", toks(0, 8), 20)
    b = e.add_request("b", toks(100, 8), 20)
    e.run()
    assert a.num_preemptions == 0 and b.num_preemptions >= 1 and e.counters.preemptions >= 1
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 20
    # Recompute produced the very tokens an unconstrained engine produces.
    roomy = EngineModel(make_profile())
    a2 = roomy.add_request("a", toks(0, 8), 20)
    b2 = roomy.add_request("b", toks(100, 8), 20)
    roomy.run()
    assert a.output_token_ids == a2.output_token_ids and b.output_token_ids == b2.output_token_ids
    # The victim's re-admission hit its own cached blocks and is counted apart.
    assert e.counters.preempted_queries > 0 and e.counters.preempted_hits > 0
    assert e.counters.prefix_cache_queries == 16 and e.counters.prefix_cache_hits == 0
    assert e.kv.pool.num_free == 8


def test_heavy_load_on_a_small_cache_never_crashes_and_frees_everything() -> None:
    e = EngineModel(make_profile(num_blocks=16, max_model_len=64, budget=32, max_num_seqs=6))
    rng = random.Random(7)
    shared = toks(0, 12)
    for i in range(120):
        prompt = shared + [rng.randrange(2048) for _ in range(rng.randint(1, 30))]
        e.add_request(f"r{i}", prompt, rng.randint(1, 60 - len(prompt)), arrival_time=i * 0.01)
        if i % 17 == 5:
            e.run_until(i * 0.01)
            e.abort(f"r{i - 3}")
    e.run()
    reqs = e.requests.values()
    assert all(r.status is Status.FINISHED for r in reqs)
    assert sum(r.finish_reason == "abort" for r in reqs) == e.counters.requests_aborted > 0
    assert e.counters.requests_finished + e.counters.requests_aborted == 120
    assert e.counters.preemptions > 0
    assert e.kv.pool.num_free == 16 and all(b.ref_cnt == 0 for b in e.kv.pool.blocks)
    assert not e.running and not e.waiting


# --- prefix-cache counters and eviction through the engine ------------------------------------


def test_hit_counters_are_exact_for_a_scripted_sequence() -> None:
    e = EngineModel(make_profile())
    S, X, Y = toks(0, 8), toks(100, 6), toks(200, 6)
    script = [
        ("r1", S + X, 0),  # 14 tokens, nothing cached yet
        ("r2", S + Y, 8),  # S's two blocks
        ("r3", S + X, 12),  # r1's three full blocks (14 // 4), and 12 <= 13
        ("r4", S, 4),  # 8 tokens, both blocks cached, but at most 7 may hit: one block
    ]
    for rid, prompt, _ in script:
        e.add_request(rid, prompt, 1)
        e.run()
    assert [e.requests[rid].num_cached_tokens for rid, _, _ in script] == [h for _, _, h in script]
    assert e.counters.prefix_cache_queries == 14 + 14 + 14 + 8
    assert e.counters.prefix_cache_hits == 0 + 8 + 12 + 4


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    e = EngineModel(make_profile())
    r = e.add_request("turn1", toks(0, 6), 6)  # 12 tokens; 11 computed: blocks 0-1 full and cached
    e.run()
    nxt = e.add_request("turn2", [*r.token_ids[:8], 500, 501], 1)
    e.run()
    assert nxt.num_cached_tokens == 8


def test_requests_in_the_same_step_do_not_hit_each_other() -> None:
    e = EngineModel(make_profile())
    a = e.add_request("a", toks(0, 20), 1)
    b = e.add_request("b", toks(0, 20), 1)
    e.run()
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    c = e.add_request("c", toks(0, 20), 1)
    e.run()
    assert c.num_cached_tokens == 16


def test_eviction_through_the_engine_is_lru_and_tail_first() -> None:
    e = EngineModel(make_profile(num_blocks=8, max_model_len=32))
    e.add_request("a", toks(0, 12), 1)  # blocks 0, 1, 2
    e.run()
    assert e.kv.pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]  # a's tail block first
    e.add_request("b", toks(100, 24), 1)  # 6 blocks: 3-7, then a's tail (block 2) is evicted
    e.run()
    assert e.kv.pool.evictions == 1
    again = e.add_request("a2", [*toks(0, 12), 999], 1)  # could hit all 3 of a's blocks
    e.run()
    assert again.num_cached_tokens == 8  # a's head survived, its tail did not


def test_abort_frees_blocks_at_any_stage() -> None:
    e = EngineModel(make_profile(budget=8))
    r = e.add_request("r", toks(0, 20), 5)
    e.step()  # one 8-token chunk
    assert r.status is Status.RUNNING and e.kv_usage() > 0
    assert e.abort("r") and not e.abort("r") and not e.abort("unknown")
    assert e.kv_usage() == 0 and r.finish_reason == "abort" and not e.has_work()
    e.add_request("p", toks(0, 4), 1, arrival_time=10.0)
    assert e.abort("p") and e.next_arrival() is None


# --- the rest -------------------------------------------------------------------------------


def test_fake_tokens_are_deterministic_and_in_vocab() -> None:
    ids = [fake_token_id(42, i, 2048) for i in range(1000)]
    assert ids == [fake_token_id(42, i, 2048) for i in range(1000)]
    assert all(0 <= t < 2048 for t in ids) and len(set(ids)) > 500


def test_ten_virtual_minutes_run_in_seconds() -> None:
    e = EngineModel(get_profile("llama-3.1-8b-h100"), keep_finished=False)
    rng = random.Random(3)
    system = [rng.randrange(128_000) for _ in range(500)]
    t = 0.0
    while t < 600:
        t += rng.expovariate(1.0)
        prompt = system + [rng.randrange(128_000) for _ in range(rng.randint(20, 800))]
        e.add_request(f"r{t}", prompt, rng.randint(20, 300), arrival_time=t)
    start = time.perf_counter()
    e.run()
    assert time.perf_counter() - start < 10
    assert e.now > 600 and not e.requests
    assert e.counters.prefix_cache_hits > 0.3 * e.counters.prefix_cache_queries


def test_the_first_step_after_the_engine_ran_dry_pays_the_idle_wake() -> None:
    """No cost while the threads still spin (idle <= from), all of it once asleep (>= to),
    linear between; none while the engine has work, even if a step starts late."""
    base = make_profile()
    wake, frm, to = 2e-3, 5e-3, 45e-3
    profile = base.with_engine(idle_wake_s=wake, idle_wake_from_s=frm, idle_wake_to_s=to)
    one = OVERHEAD + 8 * PREFILL  # a lone 8-token prefill step
    e = EngineModel(profile)
    r0 = e.add_request("r0", toks(0, 8), 1, arrival_time=1.0)  # idle since start: a full wake
    e.run()
    assert r0.ttft == pytest.approx(one + wake)
    ends = r0.finish_time
    assert ends is not None
    for i, idle in enumerate((3e-3, 25e-3, 200e-3)):  # spinning, half way, asleep
        r = e.add_request(f"r{i + 1}", toks(100 * (i + 1), 8), 1, arrival_time=ends + idle)
        e.run()
        assert r.ttft == pytest.approx(one + profile.engine.idle_wake(idle))
        ends = r.finish_time
        assert ends is not None
    assert profile.engine.idle_wake(3e-3) == 0.0
    assert profile.engine.idle_wake(25e-3) == pytest.approx(wake / 2)
    assert profile.engine.idle_wake(200e-3) == wake
    # Busy: a request arriving while another decodes waits for the step boundary, no wake; nor
    # does a busy engine's step that starts late (the real-time driver's sleep overshot).
    long = e.add_request("long", toks(900, 8), 20, arrival_time=ends + 1.0)
    e.run_until(ends + 1.0 + one + wake + 0.05)
    late = e.step(now=e.now + 0.03)
    assert late is not None and late.end - late.start == pytest.approx(OVERHEAD + DECODE_BASE + PER_SEQ)
    t = e.now + 0.0004
    busy = e.add_request("busy", toks(950, 8), 1, arrival_time=t)
    e.run()
    assert long.num_output_tokens == 20
    step = OVERHEAD + 8 * PREFILL + DECODE_BASE + PER_SEQ  # its prefill beside long's decode
    boundary = min(x for x in long.token_times if x >= t)
    assert busy.first_token_time == pytest.approx(boundary + step)


def test_idle_wake_ramp_is_validated() -> None:
    with pytest.raises(ValueError, match="idle_wake_to_s"):
        make_profile().with_engine(idle_wake_s=1e-3, idle_wake_from_s=0.05, idle_wake_to_s=0.01)
