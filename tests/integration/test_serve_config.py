"""Deploy the way platform teams do: the RayService's own ``serveConfigV2``, through Ray's own CLI.

The cpu-dev overlay (simulated engines, no GPU), built from the base as kustomize would, is
deployed with ``serve deploy`` onto a Ray head started like the manifests' cpu pod (its custom
``llmc_cpu_node`` resource, the data plane's environment), with only the HTTP host and port
changed; then ``serve status`` and a streamed chat completion through it, and ``serve run`` of
the README's local command. The GPU base's args build the application graph without starting
any GPU replica. These are the commands of the README's "Deploy with Serve's CLI" section.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cluster.dataplane import SERVE_ENV
from cluster.k8s.kustomize import build, find
from cluster.k8s.rayservice import CPU_NODE_RESOURCE
from deployments.launcher.local import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TAG = "LLMC_SERVE_CONFIG_TEST"


def serve_config_of(overlay: Path) -> dict[str, Any]:
    rs = find(build(overlay), "RayService")
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    """A Ray head like the cpu pod, on loopback, with the env the manifests give every pod."""
    import tempfile

    from deployments.launcher.local import scratch_env

    # Short: Ray's and HAProxy's unix socket paths live under it (at most ~100 characters).
    tmp = Path(tempfile.mkdtemp(prefix="llmc-cfg-", dir="/tmp"))
    env = {**os.environ, **scratch_env(), **SERVE_ENV}
    env.pop("LLMC_INTERNAL_TOKEN", None)  # cpu-dev sets none: the credential comes from Ray's token
    env["LLMC_ENGINE_HOST"] = "127.0.0.1"
    env["RAY_AUTH_MODE"] = "token"  # the CLI's clients present the cluster's token to the dashboard
    env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] = str(tmp / "hap" / "haproxy.cfg")
    env["RAY_SERVE_HAPROXY_SOCKET_PATH"] = str(tmp / "hap" / "admin.sock")
    env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] = str(tmp / "hap")
    env["RAY_SERVE_HAPROXY_SERVER_STATE_FILE"] = str(tmp / "hap" / "state")
    env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(free_port())
    env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(free_port())
    env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "2"
    # A second Ray beside the test session's own on two cores: Serve's 5 s ready check of its
    # proxy timed out on a loaded box and Serve killed the HAProxy manager (`serve run` then failed
    # with ActorDiedError, 2026-12-02). The manifests' pods have a node each; here, give it time.
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "30"
    env["PYTHONPATH"] = str(ROOT)
    # Every process of this Ray cluster inherits the tag: teardown ends exactly those (`ray stop`
    # would end every Ray on the machine, the test session's own included).
    env[TAG] = tmp.name
    (tmp / "hap").mkdir()
    gcs, dash = free_port(), free_port()
    head = [
        str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--num-cpus", "8",
        "--resources", json.dumps({CPU_NODE_RESOURCE: 1000}), "--temp-dir", str(tmp / "ray"),
        "--disable-usage-stats",
    ]  # fmt: skip
    started = subprocess.run(head, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
    env["LLMC_DASHBOARD"] = f"http://127.0.0.1:{dash}"
    try:
        yield env
    finally:
        _kill_tagged(env[TAG])
        _kill_haproxy(tmp / "hap")


def _kill_tagged(tag: str) -> None:
    import psutil

    def tagged() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                    out.append(p)
            except (psutil.Error, OSError):
                continue
        return out

    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = tagged()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        psutil.wait_procs(procs, timeout=15)
    assert not tagged(), "processes of the test's Ray cluster outlived it"


def _kill_haproxy(folder: Path) -> None:
    for pid in _haproxy_pids(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _serve_down(env: dict[str, str]) -> None:
    """``serve shutdown``, then wait for its HAProxy to exit: the next test's ``serve run`` starts one
    on the same stats and metrics ports (this Ray's env), and CI saw it fail to bind them ("Some
    protocols failed to start their listeners") while the last one was still going. One still
    there after 30 s is killed: this module tests Serve's deploy path, not its shutdown."""
    down = subprocess.run(
        [str(BIN / "serve"), "shutdown", "-a", env["LLMC_DASHBOARD"], "-y"], env=env, timeout=120
    )
    assert down.returncode == 0
    folder = Path(env["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent
    deadline = time.monotonic() + 30
    while _haproxy_pids(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    _kill_haproxy(folder)


def _haproxy_pids(folder: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "haproxy" in cmd.split(" ", 1)[0] and str(folder) in cmd:
                out.append(int(d.name))
    return out


def _stream_one(port: int, model: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    """A streamed chat completion once the app answers (it may still be starting)."""
    body = {"model": model, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            with httpx.stream(
                "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30
            ) as r:
                if r.status_code == 200:
                    lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
                    assert lines[-1] == "[DONE]", lines
                    return [json.loads(x) for x in lines[:-1]]
                last = (r.status_code, r.read())
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"no streamed answer within {timeout_s} s: {last}")


def test_cpu_dev_serve_config_deploys_with_serve_deploy(ray_head: dict[str, str], tmp_path: Path) -> None:
    conf = serve_config_of(ROOT / "k8s" / "overlays" / "cpu-dev")
    port = free_port()
    conf["http_options"].update(host="127.0.0.1", port=port)  # the only change
    path = tmp_path / "serve-config.yaml"
    path.write_text(yaml.safe_dump(conf))
    dash = ray_head["LLMC_DASHBOARD"]
    out = subprocess.run(
        [str(BIN / "serve"), "deploy", "-a", dash, str(path)],
        env=ray_head,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    model = conf["applications"][0]["args"]["config"]["models"][0]["name"]
    chunks = _stream_one(port, model)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text and chunks[0]["model"] == model
    status = subprocess.run(
        [str(BIN / "serve"), "status", "-a", dash], env=ray_head, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    app = yaml.safe_load(status.stdout)["applications"]["llm-cluster"]
    assert app["status"] == "RUNNING", status.stdout
    assert set(app["deployments"]) == {"Gateway", "backend-sim-llama-8b", "backend-sim-fallback"}
    _serve_down(ray_head)


def test_serve_run_with_a_config_path(ray_head: dict[str, str], tmp_path: Path) -> None:
    """``serve run`` of a Serve config whose app takes ``config_path`` (the README's local form)."""
    port = free_port()
    conf = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "llm-cluster-sim",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": {"config_path": str(ROOT / "configs" / "sim-local.yaml")},
            }
        ],
    }
    path = tmp_path / "serve-run.yaml"
    path.write_text(yaml.safe_dump(conf))
    run = subprocess.run(
        [str(BIN / "serve"), "run", "--non-blocking", "-a", ray_head["RAY_ADDRESS"], str(path)],
        env=ray_head,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    chunks = _stream_one(port, "sim-llama-8b")
    assert chunks and chunks[0]["model"] == "sim-llama-8b"
    _serve_down(ray_head)


def test_gpu_base_args_build_the_graph_without_gpus() -> None:
    from deployments.app import build_app

    conf = serve_config_of(ROOT / "k8s" / "overlays" / "gpu")
    app_spec = conf["applications"][0]
    graph = build_app(app_spec["args"])  # the dict, as Serve hands it over
    gateway = graph._bound_deployment
    assert gateway.name == "Gateway"
    engines = gateway.init_args[1]
    cfg = app_spec["args"]["config"]
    want = {b["name"] for b in cfg["backends"] if b["kind"] != "provider"}
    assert set(engines) == want
    budgets = gateway.init_args[2]  # a provider backend with a limit: its app-scoped budget
    limited = {
        b["name"]
        for b in cfg["backends"]
        if b["kind"] == "provider" and any(b["provider"].get(k) for k in ("rpm", "tpm", "max_in_flight"))
    }
    assert set(budgets) == limited and limited
    names = {d["name"] for d in app_spec["deployments"]}
    assert names == {"Gateway", *(f"backend-{b}" for b in want), *(f"budget-{b}" for b in limited)}
    for name, bound in engines.items():
        assert bound._bound_deployment.name == f"backend-{name}"
    for name, bound in budgets.items():
        assert bound._bound_deployment.name == f"budget-{name}"


def test_build_app_names_the_bad_field() -> None:
    from deployments.app import build_app

    with pytest.raises(ValueError, match="config_path"):
        build_app({"config_path": 42})
    with pytest.raises(ValueError, match="give exactly one"):
        build_app({})
