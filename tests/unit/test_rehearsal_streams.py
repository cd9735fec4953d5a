"""The node-loss event's own long streams (loadtest/benchmarks/rehearsal_streams.py): reading a stream's
lines, picking the node that holds most of them, and counting the ones in flight on the lost node
at the kill (completed, token for token the reference's, hung) from hand-made streams."""

from __future__ import annotations

from loadtest.benchmarks import rehearsal_stats as rs
from loadtest.benchmarks.rehearsal_streams import Seen, _line, body, busiest_node, tally


def done(replica: str, ids: list[int], t0: float = 0.0, t_end: float = 20.0) -> Seen:
    return Seen(replica, ids, True, "length", None, {"completion_tokens": len(ids)}, t0, t_end)


def test_lines_ids_usage_and_end() -> None:
    s = Seen()
    for line in (
        ": ids 5,6",
        'data: {"choices":[{"delta":{"content":"ab"}}]}',
        ": ids 7",
        'data: {"choices":[{"delta":{},"finish_reason":"length"}]}',
        'data: {"choices":[],"usage":{"completion_tokens":3}}',
        "data: [DONE]",
    ):
        _line(s, line)
    assert s.ids == [5, 6, 7] and s.completed(3) and not s.completed(4)
    _line(s, 'data: {"error":{"code":"stream_interrupted"}}')
    assert not s.completed(3)
    b = body("m", 2, 100, 10)
    assert b["ignore_eos"] and b["seed"] == 12 and b["max_tokens"] == 100  # self-hosted, seeded


def test_busiest_node() -> None:
    seen = [Seen("a"), Seen("b"), Seen("c"), Seen(None)]
    assert busiest_node(seen, {"a": "engine-0", "b": "engine-1", "c": "engine-1"}) == "engine-1"
    assert busiest_node([Seen(None)], {}) is None


def test_tally_counts_the_lost_nodes_streams() -> None:
    ref = [done("x", [1, 2, 3, 4]) for _ in range(5)]
    seen = [
        done("lost", [1, 2, 3, 4]),  # migrated, identical
        done("lost", [1, 2, 2, 4]),  # completed, one token wrong at the seam
        Seen("lost", [1, 2], False, None, "hung: ReadTimeout", None, 0.0, 40.0),  # hung
        done("lost", [1, 2, 3, 4], t_end=5.0),  # ended before the kill: not in flight
        done("kept", [1, 2, 3, 4]),
    ]
    out = tally(seen, ref, ["lost"], kill=10.0, max_tokens=4)
    assert out["in_flight_on_lost"] == 3 and out["completed"] == 2
    assert out["identical_to_reference"] == 1 and out["hung"] == 1
    assert out["others"] == 2 and out["others_completed"] == 2 and out["reference_completed"] == 5


def test_flat_keys_add_the_events_streams() -> None:
    ev = {
        "steady": [0, 10],
        "during": [10, 30],
        "after": [30, 40],
        "kill": 10.0,
        "lost_replicas": ["r"],
        "long_streams": {"in_flight_on_lost": 4, "completed": 3, "identical_to_reference": 3, "hung": 1},
    }
    records = [{"surface": "agent", "t0": 9, "t_end": 12, "ttft_s": 0.1, "error": None, "replica": "r"}]
    out = rs.flat_keys(records, {"node_loss": ev}, "sim")
    assert out["node_loss_streams_in_flight"] == 5 and out["node_loss_streams_completed"] == 4
    assert out["node_loss_streams_identical"] == 3 and out["node_loss_hung"] == 1


def test_the_kill_waits_for_streams_in_flight_on_one_node() -> None:
    from loadtest.benchmarks.rehearsal_streams import LongStreams

    ls = LongStreams(lambda fn, t: fn(), ["http://x"], "t", "m", n=4)
    node_of = {"a": "engine-0", "b": "engine-1"}
    ls.seen[:] = [Seen("a", [1] * 20), Seen("a", [1] * 5), Seen("b", [1] * 20), done("a", [1] * 20)]
    assert ls.wait_on_node(node_of, 2, 16, timeout_s=0.1) is None  # one on each node with tokens
    ls.seen[1].ids += [1] * 11
    assert ls.wait_on_node(node_of, 2, 16, timeout_s=0.1) == "engine-0"
