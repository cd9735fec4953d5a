"""Faults under load (the short form of ``loadtest/benchmarks/faults.py``): a gateway replica killed, an
engine replica killed, a provider stalling mid-stream, 429/500/529 windows. Nobody hangs, every error is an
OpenAI error, the cluster serves normally again, and the books balance: each gateway replica's
counters, and the tokens the providers counted against the usage our clients were given."""

from __future__ import annotations

import json
import os

import pytest

from loadtest.benchmarks.faults import FAULTS, LONG, SHORT, markdown, public, run_faults
from loadtest.common.actor_probe import find_in_logs, log_dir, metrics_text

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


@pytest.fixture(scope="module")
def fault_run(rel, tmp_path_factory):
    scale = LONG if os.environ.get("LLMC_LONG") == "1" else SHORT
    summary = run_faults(rel.name, rel.base_url, rel.keys, rel.oai, rel.ant, scale)
    out = tmp_path_factory.mktemp("faults") / "faults.json"
    out.write_text(json.dumps(public(summary), indent=2, default=str))
    print("\n" + markdown(summary))
    return summary


def test_every_fault_was_injected_and_nobody_hung(fault_run) -> None:
    assert [f["fault"] for f in fault_run["faults"]] == [
        f for f in FAULTS for _ in range(fault_run["scale"]["repeats"])
    ]
    for f in fault_run["faults"]:
        assert f["hung"] == 0, f
        assert f["cohort"] > 0, f
    assert fault_run["endings"].get("hung", 0) == 0, fault_run["endings"]


def test_streams_end_cleanly_and_errors_are_openai_errors(fault_run) -> None:
    assert fault_run["endings"].get("truncated", 0) == 0, fault_run["endings"]
    assert fault_run["bad_error_shape"] == 0
    for f in fault_run["faults"]:
        if f["fault"] != "kill_gateway":
            assert f["conn_error"] == 0, f
            continue
        # The gateway replica is the process that holds its clients' HTTP connections (behind
        # HAProxy): killed, it takes the streams it was serving with it, and nothing is left to
        # write them an error event. Only those may break: every broken connection was on the victim
        # at the kill, and no request sent once it was gone lost its connection (HAProxy retries a
        # refused connection on the other replica). One answered names its gateway (x-llmc-gateway):
        # the victim. One not answered yet: at most the victim's in-flight and queued counts read
        # just before the kill, plus what was sent from that read until its process was gone, plus
        # what was sent before and unanswered at the read (in a gateway's door, not yet admitted:
        # a CI run at 3414733 broke 3 where in-flight + queued + sent after the read were 2).
        k = f["kill"]
        # One of the two replicas, never the last one standing: a repeat that trusted Serve's status
        # (a killed replica counted RUNNING until its health check fails) killed the only live
        # gateway, and the requests of the next ~25 s waited for a replacement to start.
        assert len(k["replicas_at_kill"]) == 2, k
        assert k["victim_in_flight"] is not None and k["process_gone_s"] is not None, k
        assert k["conn_error_sent_after_gone"] == 0 and k["conn_error_ended_before_kill"] == 0, k
        assert k["conn_error_answered_by_other"] == 0, k
        held = k["victim_in_flight"] + k["victim_waiting"] + k["sent_between_read_and_gone"]
        assert k["conn_error_unanswered"] <= held + k["unanswered_at_read"], (f, k)


def test_the_cluster_recovers_from_every_fault(fault_run) -> None:
    for f in fault_run["faults"]:
        assert f["recovery_s"] is not None, f
        if f["fault"] in ("kill_sim_replica", "kill_gateway"):
            assert f["restored_s"] is not None, f


def test_failover_absorbs_provider_errors(fault_run) -> None:
    """429 and 500 from the OpenAI provider fail over to the simulated replicas before the first token;
    what does not (the retry budget spent) is a clean, typed error: never a 5xx of ours or a hang."""
    for f in fault_run["faults"]:
        if f["fault"] in ("provider_429", "provider_500"):
            assert f["failed_over"] + f["error_status"] > 0, f  # the window was felt
            assert set(f["error_codes"]) <= {"rate_limit_exceeded", "backend_unavailable"}, f
        if f["fault"] == "anthropic_529":  # nothing to fail over to
            assert set(f["error_codes"]) <= {"overloaded"}, f


def test_gateway_counters_balance(fault_run) -> None:
    """Each gateway replica's books: admitted = completed + errored + cancelled (+ in flight), just
    before one of them is killed and at the end (the killed one's books are gone with it)."""
    before = fault_run["gateway_counters_before_kill"]
    end = fault_run["gateway_counters_end"]
    assert before and end, (before, end)
    assert fault_run["gateway_killed"] in before and fault_run["gateway_killed"] not in end
    for c in before.values():
        assert c["balanced"] and c["double_release"] == 0, c
    for c in end.values():
        assert c["balanced"] and c["in_flight"] == 0 and c["double_release"] == 0, c
    assert sum(c["admitted"] for c in end.values()) > 0


def _gateway_died_holding(r) -> bool:
    """How a client sees a gateway die while it holds the client's request: the connection breaks,
    or HAProxy answers for the dead server with our 503."""
    if r.outcome == "conn_error":
        return True
    return r.outcome == "error_status" and r.error_code == "gateway_unavailable"


def test_provider_tokens_billed_equal_our_usage(fault_run) -> None:
    """Every request the OpenAI provider finished is one our client got, with the same usage (matched
    by request id); the rest of the billed tokens are those of requests our client saw fail."""
    acc = fault_run["accounting"]
    oai = acc["openai"]
    assert oai["provider_requests_ok"] > 0
    assert oai["per_request_mismatches"] == [], oai
    # A request the provider finished whose id our client never saw: only one the killed gateway
    # held before any byte of answer, at most one per such record. Its client saw the connection
    # break, or HAProxy's answer for a server that died before answering, which is our OpenAI 503
    # `gateway_unavailable` (deployments/haproxy_errors.py). A CI run at ceaf140 had one finished
    # request whose id its client never saw, one such 503 in the gateway kill's window, and no
    # broken connection without an id.
    no_id = [r for r in fault_run["_records"] if not r.request_id and _gateway_died_holding(r)]
    assert len(oai["finished_unknown"]) <= len(no_id), (oai["finished_unknown"], len(no_id))
    assert oai["diff_delivered"] == 0, oai
    for label in ("openai", "anthropic"):
        assert acc[label]["served_without_usage"] == 0, acc
        # Anthropic requests carry no id of ours: the total is compared exactly in
        # test_accounting.py; here a finished answer may go undelivered, but only to a client that
        # got no answer (the killed gateway's), at most one request's tokens each.
        a = acc[label]
        assert 0 <= a["diff"] <= a["unserved_requests"] * a["max_billed_per_request"], a


def test_provider_key_never_leaks(fault_run, rel) -> None:
    """Not in any error a client got, nor in Ray's logs of this session, nor in the metrics."""
    key = rel.keys.provider
    assert not [r.request_id for r in fault_run["_records"] if key in r.error_text]
    logs = log_dir()
    assert find_in_logs(logs, f"{rel.name}#Gateway"), "not the log folder of this Ray session"
    assert find_in_logs(logs, key) == []
    metrics = metrics_text()
    assert "llmc_" in metrics, "Ray's metrics agent did not answer"
    assert key not in metrics
