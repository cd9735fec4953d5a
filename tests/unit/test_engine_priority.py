"""The simulated engine's priority policy (vLLM v1's ``scheduling_policy="priority"``): the waiting
queue ordered by priority then arrival, lower-priority running work preempted first for memory."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.engine.model import EngineModel
from cluster.engine.request_queue import SchedulingPolicy, WaitQueue
from tests.unit.test_engine_model import make_profile, toks

TAB, AGENT = 0, 2


def _full_batch_then_tab(policy: SchedulingPolicy) -> EngineModel:
    """Two Agent requests fill the batch (max_num_seqs 2), two more Agent requests wait, then a Tab
    request arrives."""
    e = EngineModel(make_profile(max_num_seqs=2, max_model_len=64), scheduling_policy=policy)
    for i in range(2):  # they end at different steps: one seat frees at a time
        e.add_request(f"agent-run-{i}", toks(100 * i, 16), 12 + 8 * i, priority=AGENT)
    e.run_until(0.05)  # both running, decoding
    assert e.num_running == 2
    for i in range(2):
        e.add_request(f"agent-wait-{i}", toks(1000 + 100 * i, 16), 12, priority=AGENT)
    e.add_request("tab", toks(5000, 8), 4, arrival_time=e.now + 0.001, priority=TAB)
    e.run()
    return e


def test_tab_arriving_at_a_full_batch_is_scheduled_before_waiting_agent_work() -> None:
    e = _full_batch_then_tab("priority")
    tab = e.requests["tab"].first_scheduled_time
    waiting = [e.requests[f"agent-wait-{i}"].first_scheduled_time for i in range(2)]
    assert tab is not None and all(t is not None for t in waiting)
    assert all(tab < t for t in waiting if t is not None)
    # The running Agent requests were not preempted for it (vLLM preempts only for memory).
    assert e.counters.preemptions == 0


def test_fcfs_serves_the_same_tab_request_after_the_waiting_agent_work() -> None:
    e = _full_batch_then_tab("fcfs")
    tab = e.requests["tab"].first_scheduled_time
    first_waiting = e.requests["agent-wait-0"].first_scheduled_time
    assert tab is not None and first_waiting is not None and first_waiting < tab


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "tab"), ("priority", "agent")])
def test_memory_pressure_preempts_the_lower_priority_request(policy: SchedulingPolicy, victim: str) -> None:
    # 8 blocks of 4 tokens; each request grows to 28 tokens (7 blocks): they cannot both run.
    e = EngineModel(make_profile(num_blocks=8, max_model_len=32), scheduling_policy=policy)
    agent = e.add_request("agent", toks(0, 8), 20, priority=AGENT)
    tab = e.add_request("tab", toks(100, 8), 20, priority=TAB)  # newer: fcfs's victim
    e.run()
    by_name = {"agent": agent, "tab": tab}
    assert by_name[victim].num_preemptions >= 1
    assert by_name["tab" if victim == "agent" else "agent"].num_preemptions == 0
    assert agent.num_output_tokens == tab.num_output_tokens == 20
    assert e.kv.pool.num_free == 8


def test_within_a_surface_a_cached_context_runs_before_an_earlier_miss() -> None:
    """The gateway's cache rank (GenerateRequest.engine_priority): with the batch full, a request
    whose prompt is cached queued after one whose prompt is not; the engine runs the cached one
    first, and it hits (the miss's prefill would have come first under fcfs)."""
    from cluster.wire.protocol import GenerateRequest, Sampling

    def prio(rank: int) -> int:
        return GenerateRequest(
            "x", "m", "chat", [1], Sampling(max_tokens=1), priority=AGENT, cache_rank=rank
        ).engine_priority

    e = EngineModel(make_profile(max_num_seqs=1, max_model_len=64), scheduling_policy="priority")
    e.add_request("warm", toks(0, 16), 1, priority=prio(1))
    e.run()
    e.add_request("run", toks(500, 8), 12, priority=prio(1))
    e.step()
    e.add_request("miss", toks(900, 16), 2, priority=prio(1))
    e.add_request("hit", toks(0, 16) + toks(40, 4), 2, arrival_time=e.now + 0.001, priority=prio(0))
    e.run()
    hit, miss = e.requests["hit"], e.requests["miss"]
    assert hit.first_scheduled_time is not None and miss.first_scheduled_time is not None
    assert hit.first_scheduled_time < miss.first_scheduled_time
    assert hit.num_cached_tokens >= 12 and miss.num_cached_tokens == 0


def test_abort_takes_a_waiting_request_out_of_the_priority_queue() -> None:
    e = EngineModel(make_profile(max_num_seqs=1), scheduling_policy="priority")
    e.add_request("run", toks(0, 8), 8, priority=AGENT)
    e.step()
    e.add_request("a", toks(100, 8), 4, priority=AGENT)
    e.add_request("b", toks(200, 8), 4, priority=TAB)
    assert e.abort("b") and e.num_waiting == 1
    e.run()
    assert e.requests["a"].finish_reason == "length" and e.requests["b"].finish_reason == "abort"


@dataclass
class _R:
    name: str
    priority: int
    arrival_time: float


def test_wait_queue_orders() -> None:
    a, b, c, d = _R("a", 2, 0.0), _R("b", 0, 1.0), _R("c", 2, 0.5), _R("d", 0, 1.0)
    pq: WaitQueue[_R] = WaitQueue("priority")
    fifo: WaitQueue[_R] = WaitQueue("fcfs")
    for r in (a, b, c, d):
        pq.add(r)
        fifo.add(r)
    assert [r.name for r in pq] == ["b", "d", "a", "c"]  # priority, arrival, then insertion
    assert [r.name for r in fifo] == ["a", "b", "c", "d"]
    # A preempted request: fcfs puts it in front, priority by its key.
    late = _R("late", 1, 9.0)
    pq.prepend(late)
    fifo.prepend(late)
    assert fifo.peek() is late and [r.name for r in pq][:3] == ["b", "d", "late"]
    pq.remove(d)
    assert [pq.pop().name for _ in range(len(pq))] == ["b", "late", "a", "c"]
    with pytest.raises(ValueError):
        pq.remove(d)
    with pytest.raises(ValueError):
        WaitQueue("lifo")  # type: ignore[arg-type]
