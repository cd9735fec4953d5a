"""Production rehearsal (issue 41): the lab (``cluster lab``: a head, two cpu pods for the gateways,
two engine pods, each a Ray node in a network namespace, the app deployed with ``serve deploy`` of the
manifest's serveConfigV2) under Locust load from the client namespace, while a schedule applies one
event after another, each after a steady state:

* ``upgrade``: ``serve deploy`` of the config with an engine argument changed (every engine and
  gateway replica restarts);
* ``node_loss``: SIGKILL of every process of the engine node that holds most of the event's own
  long self-hosted streams (``loadtest/benchmarks/rehearsal_streams.py``: each then followed to its end and
  compared token for token with a reference run), then a replacement pod rejoins;
* ``kv_feed_cut``: one engine replica's KV-event endpoint unreachable for 30 s while it serves
  (its fault hook, ``POST /kv_events/fault`` with the internal credential: this machine has no
  packet filter to cut that one path), until every gateway's feed has caught up again;
* ``gateway_replica``: SIGKILL of one gateway replica's process;
* ``cpu_node``: SIGKILL of every process of a cpu pod (a gateway, its Serve proxy), then it rejoins;
* ``provider_brownout``: the loopback provider's TTFT x10 for 60 s; ``provider_outage``: its 503s
  for 30 s.

    sudo .venv/bin/python -m loadtest.benchmarks.rehearsal [--minutes 10] [--quick] \
        [--events upgrade,node_loss]

Linux, as root. Locust (``loadtest/benchmarks/rehearsal_users.py``: the project's per-surface users, one JSON
line per request) and the loopback OpenAI provider run inside the client namespace; nothing is
sent from the host's namespace. The lab comes down at the end, whatever happened. Figures:
``loadtest/benchmarks/rehearsal_stats.py``; the result file's flat keys are the issue's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.k8s.lab_plan import LabError, LabPlan
from deployments.launcher import lab, lab_events, lab_net
from loadtest.benchmarks import rehearsal_stats as rs
from loadtest.benchmarks.rehearsal_streams import LongStreams, busiest_node, tally
from loadtest.common.provenance import git_state, provenance, write_report

ROOT = Path(__file__).resolve().parents[2]
WORK = Path("/tmp/llmc-rehearsal")
ENGINES = "backend-sim-h100"
SIM, PROVIDER = "sim-h100", "loop-openai"
LONG_STREAMS, LONG_TOKENS = 8, 1200  # the node loss's own streams: ~8 s each on the H100 profile
LONG_STREAMS_ON_NODE = 3  # the kill waits until one engine node has this many of them in flight
KEY_ENV = "LLMC_REHEARSAL_PROVIDER_KEY"
PROVIDER_PORT = 18101
PROVIDER_STEADY = "slow_first:0.1"  # a provider's first token 100 ms after the request
PROVIDER_BROWNOUT = "slow_first:1.0"  # x10
PROVIDER_OUTAGE = "503"
WATCH_S = 2.0  # the gateways' brownout state is sampled this often during a provider fault
EVENTS = (
    "upgrade",
    "node_loss",
    "kv_feed_cut",
    "gateway_replica",
    "cpu_node",
    "provider_brownout",
    "provider_outage",
)
LEFT_OUT: dict[str, str] = {}
ENGINES_NOTE = (
    "sim (llama-3.1-8b-h100 profile) on both engine nodes: vLLM-CPU engines were not run in the lab "
    "(a 2-core machine shared with other work, and the run's time)"
)
VLLM, VLLM_ENGINES = "vllm-tiny", "backend-vllm-tiny"  # configs/local.yaml's backend, one replica
VLLM_PINS = {VLLM_ENGINES: "engine-0", ENGINES: "engine-1"}  # --vllm-node: one backend per engine pod
VLLM_NOTE = (
    "--vllm-node: vLLM-CPU (configs/local.yaml's tiny random-weight model, one replica) on engine-0, "
    "sim (llama-3.1-8b-h100 profile, serving the same model) on engine-1, both on the route"
)


@dataclass(frozen=True)
class Timing:
    warm_s: float
    steady_s: float
    after_s: float
    brownout_s: float
    outage_s: float
    node_down_s: float
    kv_cut_s: float

    @staticmethod
    def of(quick: bool) -> Timing:
        return Timing(15, 15, 10, 20, 10, 5, 10) if quick else Timing(40, 40, 30, 60, 30, 8, 30)


# The lab's config -----------------------------------------------------------------------------
def rehearsal_config(provider_url: str, vllm: bool = False, kv_index: str = "gateway") -> dict[str, Any]:
    """configs/sim-local.yaml with two gateway replicas and a loopback OpenAI provider on the same
    route: provider first for Tab (hedged) and Chat, the engines first for Agent. ``vllm``: with
    configs/local.yaml's vLLM-CPU backend (one replica) too, the sim engines serving its model.
    ``kv_index`` ``indexer``: the sim backend's KV events applied by two indexer shards that the
    gateways mirror (issue 42), instead of by every gateway."""
    from loadtest.common.reliability import provider_backend

    cfg = yaml.safe_load((ROOT / "configs/sim-local.yaml").read_text())
    if vllm:
        _with_vllm(cfg)
    cfg["name"] = "llm-cluster-rehearsal"
    cfg["server"]["gateway_replicas"] = 2
    if kv_index == "indexer":
        sim = next(b for b in cfg["backends"] if b["name"] == SIM)
        sim["affinity"] = {**sim.get("affinity", {}), "kv_index": "indexer", "indexer_shards": 2}
    model = cfg["models"][0]["name"]
    prov = provider_backend(PROVIDER, "openai", provider_url, model, key_env=KEY_ENV)
    prov["provider"] |= {"connect_timeout_s": 2, "first_token_timeout_s": 5, "between_tokens_timeout_s": 3}
    cfg["backends"].append(prov)
    for s in cfg["surfaces"]:
        if s["name"] == "tab":
            s["hedging"] = True
    cfg["routes"] = [
        {"model": model, "candidates": [PROVIDER, SIM, VLLM] if vllm else [PROVIDER, SIM]},
        {
            "model": model,
            "surface": "agent",
            "candidates": [VLLM, SIM, PROVIDER] if vllm else [SIM, PROVIDER],
        },
    ]
    return cfg


def _with_vllm(cfg: dict[str, Any]) -> None:
    """configs/local.yaml's model and vLLM-CPU backend (one replica) beside the sim engines, which
    serve that model too: one route, one model, two kinds of engine."""
    local = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    cfg["models"] = local["models"][:1]
    vllm = next(b for b in local["backends"] if b["kind"] == "vllm")
    vllm |= {"name": VLLM, "replicas": 1}
    vllm.pop("host_cpu", None)  # the planner's, for local.yaml's host
    for b in cfg["backends"]:
        b["model"] = vllm["model"]
    cfg["backends"].append(vllm)


def _model(plan: LabPlan) -> str:
    """The model the lab serves (the config's first), from the Serve config it was deployed with."""
    doc = yaml.safe_load(plan.serve_config)
    return str(doc["applications"][0]["args"]["config"]["models"][0]["name"])


def write_inputs(plan_client_ip: str, vllm: bool = False, kv_index: str = "gateway") -> tuple[str, str]:
    """The config and deploy settings files (two cpu pods: one may be lost while the other serves)."""
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = rehearsal_config(f"http://{plan_client_ip}:{PROVIDER_PORT}/v1", vllm, kv_index)
    settings = yaml.safe_load((ROOT / "k8s/settings/lab.yaml").read_text())
    settings["cpu"] |= {"min_replicas": 2, "max_replicas": 2}
    (WORK / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (WORK / "settings.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return str(WORK / "config.yaml"), str(WORK / "settings.yaml")


# The processes in the client namespace -----------------------------------------------------------
def _in_client(plan: LabPlan, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LLMC_"))}
    with open(log, "ab") as f:
        return subprocess.Popen(
            ["ip", "netns", "exec", plan.client.netns, *args],
            cwd=ROOT,
            env=base | {"PYTHONPATH": str(ROOT)} | env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def start_provider(plan: LabPlan) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "fixtures.servers.openai_server", f"--host={plan.client.ip}"]
    args += [f"--port={PROVIDER_PORT}", f"--api-key-env={KEY_ENV}", "--output-tokens=48"]
    args += ["--token-delay=0.02", f"--fault={PROVIDER_STEADY}"]
    proc = _in_client(plan, args, WORK / "provider.log", {KEY_ENV: os.environ[KEY_ENV]})
    lab_events.wait_for(lambda: provider_call(plan, "GET", "stats") is not None, 30, "the loopback provider")
    return proc


def provider_call(plan: LabPlan, method: str, what: str, body: Any = None) -> Any:
    """The loopback provider's control API (``/_control/<what>``), from the client namespace."""
    import httpx

    url = f"http://{plan.client.ip}:{PROVIDER_PORT}/_control/{what}"

    def call() -> Any:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.request(method, url, json=body, timeout=5).json()
        return None

    return lab.from_client(plan, call)


class Endpoints:
    """The addresses the users spread over, as KubeRay's Serve Service selects pods: the pods the
    manifest puts in it (every worker pod, cpu and engine alike; not the head:
    ``excludeHeadPodFromServeSvc``) that pass KubeRay's readiness probe (``/-/healthz`` on the
    Serve port answers 200; a pod without a replica has no proxy, a draining proxy or one without
    its routes yet answers 503), probed every ``period_s`` (KubeRay: 5 s, one failure drops the
    pod); a lost pod is dropped at once (its deletion removes it from the Service)."""

    def __init__(self, plan: LabPlan, period_s: float = 2.0) -> None:
        self.plan, self.period_s, self.lost = plan, period_s, set[str]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="endpoints", daemon=True)
        self.changes: list[tuple[float, list[str]]] = []

    def refresh(self) -> None:
        with contextlib.suppress(LabError, OSError, TimeoutError):
            ok = {n.name for n in lab.ready_pods(self.plan)}
            names = [n.name for n in self.plan.service_nodes() if n.name in ok - self.lost]
            if not self.changes or self.changes[-1][1] != names:
                self.changes.append((time.time(), names))
                urls = [f"http://{n.ip}:{self.plan.serve_port}" for n in self.plan.nodes if n.name in names]
                (WORK / "endpoints").write_text("\n".join(urls) + "\n")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.refresh()

    def start(self) -> Endpoints:
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def start_locust(plan: LabPlan, users: int, run_s: float) -> subprocess.Popen[bytes]:
    args = [
        str(Path(sys.executable).parent / "locust"),
        "-f",
        "loadtest/benchmarks/rehearsal_users.py",
        "--headless",
    ]
    args += [
        f"--users={users}",
        f"--spawn-rate={users}",
        f"--run-time={int(run_s)}s",
        f"--host=http://{plan.head.ip}:{plan.serve_port}",
    ]
    args += ["--llmc-scale=0.3", "--llmc-timeout=60", f"--csv={WORK / 'locust'}", "--only-summary"]
    env = {
        "LLMC_REHEARSAL_RECORDS": str(WORK / "records.jsonl"),
        "LLMC_REHEARSAL_ENDPOINTS": str(WORK / "endpoints"),
    }
    return _in_client(plan, args, WORK / "locust.log", env)


# The schedule ------------------------------------------------------------------------------------
def _cpu_node_to_lose(plan: LabPlan) -> str:
    """The last cpu pod holding a gateway replica (the other keeps serving)."""
    holding = sorted(set(lab_events.replicas(plan)[lab_events.GATEWAY].values()))
    cpu = [n.name for n in plan.nodes if n.group == "cpu" and n.name in holding]
    if not cpu:
        raise LabError(f"no cpu pod holds a gateway replica: {holding}")
    return cpu[-1]


def lose_engine_node(plan: LabPlan, t: Timing, ev: dict[str, Any], endpoints: Endpoints) -> None:
    """The node loss with long self-hosted streams in flight (:mod:`loadtest.benchmarks.rehearsal_streams`):
    the streams run once as the reference, then again; once one engine node has
    ``LONG_STREAMS_ON_NODE`` of them in flight with tokens, it is killed, and each stream is
    followed to its end."""
    names = endpoints.changes[-1][1] if endpoints.changes else [plan.head.name]
    # through the cpu pods: what is measured is the engine's loss, not the client's own connection
    # to the lost pod's HAProxy (the Locust users' are counted apart: node_loss_cut_on_lost_pod)
    urls = [f"http://{n.ip}:{plan.serve_port}" for n in plan.nodes if n.name in names and n.group != "engine"]
    token = lab_events.internal_token(plan)

    def runner(fn: Any, timeout_s: float) -> Any:
        return lab_net.in_netns(plan.client.netns, fn, timeout_s)

    def streams() -> LongStreams:
        return LongStreams(runner, urls, token, _model(plan), n=LONG_STREAMS, max_tokens=LONG_TOKENS)

    t0 = time.monotonic()
    reference = streams().run(180)
    ev["long_stream_reference_s"] = round(time.monotonic() - t0, 1)
    live = streams().start()
    held = lab_events.replicas(plan)
    engines = [d for d in (ENGINES, VLLM_ENGINES) if d in held]  # --vllm-node: one of each per pod
    node_of = {r: n for d in engines for r, n in held[d].items()}
    node = live.wait_on_node(node_of, LONG_STREAMS_ON_NODE, 16, 60)
    ev["long_streams_waited_for"] = node is not None
    node = node or busiest_node(live.seen, node_of) or _most_replicas(held.get(ENGINES, {}))
    ev["long_stream_tokens_before_kill"] = sorted(len(s.ids) for s in live.seen)
    on_node = [d for d in engines if node in held[d].values()] or [ENGINES]
    ev["lost_deployment"] = on_node[0]
    # replicas of it on other nodes: without one, a stream continues on another engine (other tokens)
    ev["lost_deployment_elsewhere"] = sum(n != node for n in held.get(on_node[0], {}).values())
    lost = next(n for n in plan.nodes if n.name == node)
    ev["lost_url"] = f"http://{lost.ip}:{plan.serve_port}"
    endpoints.lost.add(node)  # the Service drops the lost pod's endpoint
    endpoints.refresh()
    lab_events.lose_node(plan, ev, on_node[0], node=node, down_s=t.node_down_s)
    endpoints.lost.discard(node)
    seen = live.join(180)
    ev["long_streams"] = tally(seen, reference, ev["lost_replicas"], ev["kill"], LONG_TOKENS)


def _most_replicas(replica_nodes: dict[str, str]) -> str:
    """The node holding the most of a deployment's replicas (replica -> node)."""
    nodes = sorted(replica_nodes.values())
    if not nodes:
        raise LabError("no engine replica is placed on any node")
    return max(nodes, key=nodes.count)


def _provider_fault(plan: LabPlan, ev: dict[str, Any], spec: str, seconds: float) -> None:
    """The provider's fault for ``seconds``, meanwhile every gateway's brownout state and hedge
    delays sampled every ``WATCH_S`` (``ev["gateways"]``: why a request still went to the provider)."""
    ev["fault"], ev["start"] = spec, time.time()
    provider_call(plan, "POST", "faults", {"default": spec})
    ev["gateways"] = watch_gateways(plan, lab_events.internal_token(plan), ev["start"] + seconds)
    provider_call(plan, "POST", "faults", {"default": PROVIDER_STEADY})
    ev["end"] = time.time()


def watch_gateways(plan: LabPlan, token: str, until: float) -> list[dict[str, Any]]:
    """Every ``WATCH_S`` until ``until``: per gateway replica its brownout state and hedge delays
    (a sample no gateway answered is left out; the fault's length does not depend on it)."""
    import httpx

    samples: list[dict[str, Any]] = []
    while (left := until - time.time()) > 0:
        t = time.time()
        with contextlib.suppress(LabError, OSError, httpx.HTTPError):
            seen = lab_events.every_gateway_status(plan, token, plan.head.name, 2, tries=6)
            by = {
                rid: {k: st["policy"].get(k) for k in ("brownout", "hedge_delay_s")}
                for rid, st in seen.items()
            }
            samples.append({"t": round(t, 3), "gateways": by})
        time.sleep(max(0.0, min(left, WATCH_S - (time.time() - t))))
    return samples


def apply_event(
    name: str, plan: LabPlan, t: Timing, ev: dict[str, Any], endpoints: Endpoints
) -> tuple[float, float]:
    """Apply one event; returns its ``during`` window: from the fault until the lab is back at full
    strength (or the fault is over)."""
    if name == "upgrade":
        lab_events.upgrade(plan, ev, ENGINES, lab_events.upgraded(plan.serve_config))
        return ev["upgrade_start"], ev["upgrade_end"]
    if name == "node_loss":
        lose_engine_node(plan, t, ev, endpoints)
        return ev["kill"], ev["kill"] + ev["back_to_full_s"]
    if name == "kv_feed_cut":
        lab_events.cut_kv_feed(plan, ev, lab_events.internal_token(plan), SIM, t.kv_cut_s)
        return ev["start"], ev["end"]
    if name == "gateway_replica":
        lab_events.kill_replica(plan, ev, lab_events.GATEWAY)
        return ev["kill"], ev["restored"]
    if name == "cpu_node":
        node = _cpu_node_to_lose(plan)
        endpoints.lost.add(node)  # the Service drops the lost pod's endpoint
        endpoints.refresh()
        lab_events.lose_node(plan, ev, lab_events.GATEWAY, node=node, down_s=t.node_down_s)
        serving = lab.node_health(plan, next(n for n in plan.nodes if n.name == node)) == 200
        ev["rejoined_serving"] = serving  # Serve starts a proxy there only once a replica lands there
        endpoints.lost.discard(node)
        return ev["kill"], ev["kill"] + ev["back_to_full_s"]
    if name == "provider_brownout":
        _provider_fault(plan, ev, PROVIDER_BROWNOUT, t.brownout_s)
        return ev["start"], ev["end"]
    if name == "provider_outage":
        _provider_fault(plan, ev, PROVIDER_OUTAGE, t.outage_s)
        return ev["start"], ev["end"]
    raise ValueError(f"unknown event {name}")


def books(plan: LabPlan, token: str, gateways: int) -> dict[str, Any]:
    """Every gateway replica's admission books (admitted = completed + errored + cancelled); not
    exact when a gateway does not answer (recorded: one bad read must not lose the run's result)."""
    import httpx

    try:
        seen = lab_events.every_gateway_status(plan, token, plan.head.name, gateways)
    except (LabError, OSError, httpx.HTTPError) as exc:
        return {"exact": False, "error": f"{type(exc).__name__}: {exc}", "gateways": {}}
    by = {rid: st["admission"] for rid, st in seen.items()}
    return {"exact": len(by) == gateways and all(a["balanced"] for a in by.values()), "gateways": by}


def run_schedule(
    plan: LabPlan, events: list[str], t: Timing, token: str, endpoints: Endpoints, say: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in events:
        ev: dict[str, Any] = {}
        t_steady = time.time()
        time.sleep(t.steady_s)
        ev["steady"] = [t_steady, time.time()]
        say(f"[rehearsal] {name}")
        try:
            ev["during"] = list(apply_event(name, plan, t, ev, endpoints))
        except LabError as exc:  # a bad event is reported, and the schedule goes on
            ev["error"] = str(exc)
            ev["during"] = [ev["steady"][1], time.time()]
        time.sleep(t.after_s)
        ev["after"] = [ev["during"][1], time.time()]
        ev["books"] = books(plan, token, 2)
        took = ev["during"][1] - ev["during"][0]
        say(f"[rehearsal] {name}: during {took:.1f} s, books {ev['books']['exact']}")
        out[name] = ev
    return out


def drain(plan: LabPlan, token: str) -> dict[str, Any]:
    """The books once the load is over: nothing in flight, balanced, on every gateway."""
    final: dict[str, Any] = {}

    def settled() -> bool:
        final.update(books(plan, token, 2))
        return final["exact"] and all(a["in_flight"] == 0 for a in final["gateways"].values())

    with contextlib.suppress(LabError):
        lab_events.wait_for(settled, 60, "the gateways' books to settle")
    final["in_flight"] = sum(a["in_flight"] for a in final.get("gateways", {}).values())
    return final


# The run -----------------------------------------------------------------------------------------
def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, wait_s: float = 60) -> int | None:
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def load_and_schedule(plan: LabPlan, args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """The provider, the load, the schedule, then the load to the end of ``--minutes``."""
    t = Timing.of(args.quick)
    token = lab_events.internal_token(plan)
    provider = locust = None
    endpoints = Endpoints(plan)
    try:
        provider = start_provider(plan)
        endpoints.start()
        locust = start_locust(plan, args.users, args.minutes * 60 + 1800)
        load_start = time.time()
        time.sleep(t.warm_s)
        run: dict[str, Any] = {"placement": lab.placement(plan), "load_start": load_start}
        run["events"] = run_schedule(plan, args.events, t, token, endpoints, say)
        time.sleep(max(0.0, load_start + args.minutes * 60 - time.time()))
        run["load_end"] = time.time()
        run["locust_rc"] = _stop(locust)
        run["endpoints"] = endpoints.changes
        run["final_books"] = drain(plan, token)
        run["provider_stats"] = {
            k: v for k, v in (provider_call(plan, "GET", "stats") or {}).items() if k != "records"
        }
        return run
    finally:
        endpoints.stop()
        _stop(locust)
        _stop(provider, wait_s=10)


def leftovers() -> dict[str, int]:
    """What of the lab is left on this machine: processes, ports on its subnet, namespaces, links."""
    import psutil

    from cluster.k8s.lab_plan import SUBNET

    left = lab.leftovers()
    prefix = SUBNET.rsplit(".", 1)[0] + "."
    ports = [c for c in psutil.net_connections("inet") if c.laddr and str(c.laddr.ip).startswith(prefix)]
    return {k: len(v) for k, v in left.items()} | {"ports": len(ports)}


def rehearse(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    import ipaddress

    from cluster.k8s.lab_plan import SUBNET

    if lab.read_state() is not None or any(lab.leftovers().values()):
        raise SystemExit("[rehearsal] a lab is up on this machine already: `cluster lab down` first")
    os.environ[KEY_ENV] = f"sk-rehearsal-{secrets.token_hex(16)}"  # the Secret's provider key
    with contextlib.suppress(FileNotFoundError):
        (WORK / "records.jsonl").unlink()
    config, settings = write_inputs(str(ipaddress.ip_network(SUBNET)[2]), args.vllm_node, args.kv_index)
    t0 = time.monotonic()
    run: dict[str, Any] = {}
    try:
        plan = lab.up(config, settings, timeout_s=600, say=say, pins=VLLM_PINS if args.vllm_node else None)
        run["up_s"] = round(time.monotonic() - t0, 1)
        run["nodes"] = [f"{n.name} ({n.group}, {n.ip})" for n in plan.nodes]
        run |= load_and_schedule(plan, args, say)
    except (LabError, OSError) as exc:
        run["error"] = f"{type(exc).__name__}: {exc}"
        say(f"[rehearsal] failed: {run['error']}")
    finally:
        lab.down(say=say)
    run["leftovers"] = leftovers()
    path = WORK / "records.jsonl"
    run["records"] = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return run


def report(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The result file: the issue's flat keys, then the per-event detail."""
    records, events = run.pop("records"), run.get("events", {})
    per_event = {name: rs.event_report(records, ev, SIM) | {"event": ev} for name, ev in events.items()}
    books_exact = bool(events) and all(ev["books"]["exact"] for ev in events.values())
    books_exact = books_exact and run.get("final_books", {}).get("exact", False)
    books_exact = books_exact and run["final_books"].get("in_flight") == 0
    return {
        "nodes": len(run.get("nodes", [])),
        "minutes": round((run.get("load_end", 0) - run.get("load_start", 0)) / 60, 1) if events else 0,
        **rs.flat_keys(records, events, SIM),
        "books_exact": books_exact,
        "leftovers": run["leftovers"],
        "engines": VLLM_NOTE if args.vllm_node else ENGINES_NOTE,
        "kv_index": args.kv_index,
        "events_run": list(events),
        "events_left_out": LEFT_OUT,
        "quick": args.quick,
        "whole_run": rs.summary(records, SIM),
        "per_event": per_event,
        "run": {k: v for k, v in run.items() if k != "events"},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the load runs at least this long")
    p.add_argument("--quick", action="store_true", help="short steady states and faults, to try it")
    p.add_argument("--users", type=int, default=10, help="Locust users (Tab:Chat:Agent 6:3:1)")
    p.add_argument("--events", default=",".join(EVENTS), help=f"comma-separated, of {','.join(EVENTS)}")
    p.add_argument(
        "--vllm-node",
        action="store_true",
        help="vLLM-CPU (configs/local.yaml's tiny model) on one engine node, sim on the other, one route",
    )
    p.add_argument(
        "--kv-index",
        choices=["gateway", "indexer"],
        default="gateway",
        help="indexer: the sim backend's KV events applied by two indexer shards the gateways mirror",
    )
    p.add_argument("--out", default=str(ROOT / "loadtest/results/rehearsal.json"))
    args = p.parse_args(argv)
    args.events = [e for e in args.events.split(",") if e]
    if bad := set(args.events) - set(EVENTS):
        p.error(f"unknown events {sorted(bad)}")
    if args.kv_index == "indexer" and "kv_feed_cut" in args.events:
        p.error("kv_feed_cut checks the gateways' own KV-event feeds: with --kv-index indexer leave it out")
    started, load_before, git = time.monotonic(), os.getloadavg(), git_state()
    run = rehearse(args)
    prov = provenance(sys.argv[1:] if argv is None else argv, git, load_before, started)
    out = report(run, args) | {"commit": git["git_commit"], "date": prov["timestamp"]}
    out |= {"load_average": prov["load_average_before"], "runtime_s": prov["runtime_s"], "provenance": prov}
    write_report(out, args.out)
    keys = ("nodes", "minutes", "upgrade_failed", "node_loss_failed_before_first_token", "books_exact")
    print(json.dumps({k: out.get(k) for k in keys}))
    return 1 if "error" in run else 0


if __name__ == "__main__":
    raise SystemExit(main())
