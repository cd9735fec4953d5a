"""The simulated engine's seeded sampler continues a request exactly, and its streams are keyed by
attempt (issue 19): what a mid-stream migration to another replica relies on."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.wire.protocol import GenerateRequest
from tests.unit.test_sim_backend import collect, greq, make, settled, toks


async def _ids(req: GenerateRequest, **options: object) -> tuple[list[int], str | None]:
    b = make(**options)
    chunks = await collect(b, req)
    assert await settled(b)
    return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


def _continuation(req: GenerateRequest, emitted: list[int]) -> GenerateRequest:
    s = dataclasses.replace(req.sampling, max_tokens=req.sampling.max_tokens - len(emitted))
    return dataclasses.replace(req, prompt_token_ids=req.prompt_token_ids + emitted, sampling=s, attempt=1)


@pytest.mark.parametrize("seed", [7, None])
@pytest.mark.parametrize("cut", [1, 9, 23])
async def test_a_continuation_on_another_replica_samples_what_the_whole_run_did(seed, cut) -> None:
    req = greq("mig", toks(3, 12), 24, seed=seed)
    whole, reason = await _ids(req)
    assert len(whole) == 24 and reason == "length"
    rest, reason2 = await _ids(_continuation(req, whole[:cut]))  # a fresh replica
    assert whole[:cut] + rest == whole and reason2 == "length"


async def test_a_continuation_ends_where_the_whole_run_ended_with_eos_draws() -> None:
    stops = 0
    for i in range(12):
        req = greq(f"eos{i}", toks(i, 10), 30)
        whole, reason = await _ids(req, eos_probability=0.15)
        stops += reason == "stop"
        if len(whole) < 2:
            continue
        cut = len(whole) // 2
        rest, reason2 = await _ids(_continuation(req, whole[:cut]), eos_probability=0.15)
        assert whole[:cut] + rest == whole and reason2 == reason
    assert stops > 0  # some ended early: the draw was exercised


async def test_the_sample_depends_on_the_prompt_and_the_seed() -> None:
    a, _ = await _ids(greq("x", toks(0, 8), 16, seed=1))
    b, _ = await _ids(greq("x", toks(1, 8), 16, seed=1))
    c, _ = await _ids(greq("x", toks(0, 8), 16, seed=2))
    assert a != b and a != c
    assert a == (await _ids(greq("other-id", toks(0, 8), 16, seed=1)))[0]  # the seed decides


async def test_two_attempts_of_one_request_on_one_replica_both_stream() -> None:
    """A retry, hedge or continuation may reach the replica that holds the first attempt: keyed by
    request id alone it got a code-less 400 'duplicate request id'."""
    b = make()
    first = b.generate(greq("same", toks(0, 4), 50))
    await anext(first)
    second = [c async for c in b.generate(dataclasses.replace(greq("same", toks(0, 4), 5), attempt=1))]
    assert len(second) == 5 and second[-1].finish_reason == "length"
    await first.aclose()  # type: ignore[attr-defined]
    assert b.stats().requests_started == 2
    assert await settled(b)


async def test_abort_by_request_id_ends_every_attempt() -> None:
    b = make()
    gens = [b.generate(dataclasses.replace(greq("ab", toks(0, 4), 500), attempt=i)) for i in (0, 1)]
    for g in gens:
        await anext(g)
    await b.abort("ab")
    for g in gens:
        last = [c async for c in g][-1]
        assert last.finish_reason == "abort"
    assert await settled(b)
