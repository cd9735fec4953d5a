"""Workload generators (loadtest/common/workloads.py): seeded, pure, shaped as asked."""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict

import pytest

from loadtest.common.request_spec import RequestSpec
from loadtest.common.workloads import (
    VOCAB,
    SharedPrefixWorkload,
    merge,
    poisson_arrivals,
    summary,
    zipf_shares,
)

SMALL = SharedPrefixWorkload(
    num_groups=3,
    sessions_per_group=2,
    turns=3,
    common_prefix_words=20,
    system_prompt_words=30,
    context_words=60,
    question_words=5,
    answer_words=7,
    max_tokens=8,
    group_skew=1.0,
    rate=10.0,
)


def by_session(specs: list[RequestSpec]) -> dict[str, list[RequestSpec]]:
    out: dict[str, list[RequestSpec]] = defaultdict(list)
    for s in specs:
        out[s.session_id].append(s)
    return out


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    a = [s.to_record() for s in SMALL.generate(1)]
    b = [s.to_record() for s in SMALL.generate(1)]
    c = [s.to_record() for s in SMALL.generate(2)]
    assert a == b
    assert a != c
    assert json.dumps(a) == json.dumps(b)  # JSON-serialisable, byte for byte


def test_json_round_trip() -> None:
    for spec in SMALL.generate(3):
        d = json.loads(json.dumps(spec.to_record()))
        assert set(d) >= {"t", "session_id", "messages", "max_tokens"}
        assert RequestSpec.from_record(d) == spec


def test_shape_counts_and_arrival_order() -> None:
    specs = SMALL.generate(4)
    assert len(specs) == SMALL.num_requests == 3 * 2 * 3
    sessions = by_session(specs)
    assert len(sessions) == SMALL.num_sessions
    assert all(len(turns) == SMALL.turns for turns in sessions.values())
    assert {s.group for s in specs} == {"g0", "g1", "g2"}
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and times[0] > 0
    assert all(s.max_tokens == 8 for s in specs)
    for turns in sessions.values():  # a session's k-th request is its turn k
        assert [t.turn for t in turns] == list(range(SMALL.turns))


def test_multi_turn_prompts_grow_by_question_and_answer() -> None:
    for turns in by_session(SMALL.generate(5)).values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.messages[: len(prev.messages)] == prev.messages  # the old prompt is a prefix
            added = cur.messages[len(prev.messages) :]
            assert [m["role"] for m in added] == ["assistant", "user"]
            assert len(added[0]["content"].split()) == SMALL.answer_words
            assert sum(len(m["content"]) for m in cur.messages) > sum(
                len(m["content"]) for m in prev.messages
            )
        assert [m["role"] for m in turns[0].messages] == ["system", "user"]


def test_groups_share_their_prefix_and_all_share_the_common_part() -> None:
    specs = SMALL.generate(6)
    system = {s.group: s.messages[0]["content"] for s in specs}
    for s in specs:  # every request of a group carries the same system prompt + context
        assert s.messages[0]["content"] == system[s.group]
    assert len(set(system.values())) == SMALL.num_groups
    common = " ".join(system["g0"].split()[: SMALL.common_prefix_words])
    assert all(text.startswith(common) for text in system.values())
    words = system["g1"].split()
    assert len(words) >= SMALL.common_prefix_words + SMALL.system_prompt_words + SMALL.context_words
    assert set(words[: SMALL.common_prefix_words]) <= set(VOCAB)


def test_without_common_prefix_groups_differ_early() -> None:
    wl = SharedPrefixWorkload(
        num_groups=4, sessions_per_group=1, turns=1, system_prompt_words=10, context_words=10
    )
    firsts = {s.messages[0]["content"][:45] for s in wl.generate(0)}
    assert len(firsts) == 4  # the group's name comes in the first sentence


def test_skew_moves_sessions_to_the_first_groups() -> None:
    wl = SharedPrefixWorkload(num_groups=6, sessions_per_group=5, turns=1, group_skew=1.5)
    per_group = defaultdict(set)
    for s in wl.generate(0):
        per_group[s.group].add(s.session_id)
    counts = [len(per_group[f"g{i}"]) for i in range(6)]
    assert sum(counts) == 30 and min(counts) >= 1
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_zipf_shares() -> None:
    assert zipf_shares(4, 12, 0.0) == [3, 3, 3, 3]
    shares = zipf_shares(5, 40, 1.0)
    assert sum(shares) == 40 and shares == sorted(shares, reverse=True)
    assert zipf_shares(3, 2, 2.0) == [2, 0, 0]  # fewer items than bins: no floor of one
    with pytest.raises(ValueError):
        zipf_shares(0, 3, 1.0)


def test_poisson_arrivals() -> None:
    times = poisson_arrivals(2000, 50.0, random.Random(0))
    assert len(times) == 2000 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert all(g > 0 for g in gaps)
    assert 0.9 / 50 < sum(gaps) / len(gaps) < 1.1 / 50  # mean gap 1/rate (seeded: deterministic)
    assert poisson_arrivals(3, 1.0, random.Random(0), start_s=10.0)[0] > 10.0
    with pytest.raises(ValueError):
        poisson_arrivals(1, 0.0, random.Random(0))


def test_rate_sets_the_span_and_start_shifts_it() -> None:
    wl = SharedPrefixWorkload(num_groups=4, sessions_per_group=5, turns=5, rate=20.0, start_s=3.0)
    specs = wl.generate(0)
    assert specs[0].arrival_s > 3.0
    assert 0.7 * 100 / 20 < specs[-1].arrival_s - 3.0 < 1.3 * 100 / 20


def test_merge_and_surface_tags() -> None:
    tab = SharedPrefixWorkload(
        num_groups=2, sessions_per_group=1, turns=2, name="tab", surface="tab"
    ).generate(0)
    agent = SharedPrefixWorkload(num_groups=2, sessions_per_group=1, turns=2, name="agent", surface="agent")
    mixed = merge(tab, agent.generate(1))
    assert len(mixed) == 8
    assert [s.arrival_s for s in mixed] == sorted(s.arrival_s for s in mixed)
    assert {s.surface for s in mixed} == {"tab", "agent"}
    assert all(s.session_id.startswith(s.surface or "") for s in mixed)
    assert summary(mixed)["requests"] == 8 and summary([]) == {"requests": 0}


def test_invalid_shapes_are_rejected() -> None:
    with pytest.raises(ValueError):
        SharedPrefixWorkload(num_groups=0).generate(0)
    with pytest.raises(ValueError):
        SharedPrefixWorkload(turns=0).generate(0)
