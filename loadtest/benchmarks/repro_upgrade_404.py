"""Smallest reproduction, without our code, of the 404s the rehearsal's in-place upgrade met (issue 41).

The sixth full rehearsal (its result file, rehearsal.json, at 292cd81) had 2 failures in its
upgrade, both ``404 Path '/v1/completions' not found. Ping http://.../-/routes for available
routes.``: the ``default_backend`` of the HAProxy config Ray Serve generates
(``ray/serve/_private/haproxy_templates.py``), which answers a request whose path no app's backend
matches. This script asks whether Serve alone does that: one local Ray node in Serve's HAProxy and
direct-ingress mode (as the cluster runs), a trivial ingress deployment with two replicas deployed
with ``serve deploy``, clients posting to it without pause, then ``serve deploy`` of the same config
with one environment variable changed (every replica restarts, as the rehearsal's upgrade does).
It prints each status seen before, during and after the upgrade, and the 404s' bodies.

    .venv/bin/python -m loadtest.benchmarks.repro_upgrade_404 [--upgrades 3]

It starts and stops its own Ray (``ray start --head --block`` on free ports, in a folder of its
own; at the end that process group and whatever names the folder, never ``ray stop``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import yaml

from cluster.dataplane import SERVE_ENV
from deployments.launcher.lab_events import wait_for
from deployments.launcher.local import free_port

BIN = Path(sys.executable).parent  # the venv's `ray` and `serve`

APP_MODULE = """
from ray import serve
from starlette.responses import PlainTextResponse


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class Ingress:
    async def __call__(self, request):
        return PlainTextResponse("ok")


app = Ingress.bind()
"""


def _config(http_port: int, version: int) -> dict[str, object]:
    return {
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": "repro",
                "route_prefix": "/",
                "import_path": "repro_app:app",
                "runtime_env": {"env_vars": {"REPRO_VERSION": str(version)}},
            }
        ],
    }


class _Clients:
    """``n`` clients posting to ``url`` without pause; every (time, status, body) kept."""

    def __init__(self, url: str, n: int = 4) -> None:
        self.url, self.seen = url, list[tuple[float, int, str]]()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set():
                t = time.time()
                try:
                    r = c.post(self.url, content=b"{}")
                    self.seen.append((t, r.status_code, r.text[:120] if r.status_code != 200 else ""))
                except httpx.HTTPError as e:
                    self.seen.append((t, -1, type(e).__name__))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)


def _deploy(folder: Path, address: str, http_port: int, version: int) -> None:
    path = folder / f"config-{version}.yaml"
    path.write_text(yaml.safe_dump(_config(http_port, version)))
    done = subprocess.run(
        [str(BIN / "serve"), "deploy", str(path), "-a", address], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"serve deploy failed: {done.stderr[-2000:]}")


def _running(address: str) -> bool:
    out = subprocess.run([str(BIN / "serve"), "status", "-a", address], capture_output=True, text=True).stdout
    doc = yaml.safe_load(out) or {}
    app = (doc.get("applications") or {}).get("repro") or {}
    deps = app.get("deployments") or {}
    return app.get("status") == "RUNNING" and all(d.get("status") == "HEALTHY" for d in deps.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upgrades", type=int, default=3)
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="llmc-repro404-"))
    (folder / "repro_app.py").write_text(APP_MODULE)
    http_port, dash = free_port(), free_port()
    env = os.environ | SERVE_ENV | {"PYTHONPATH": str(folder)}
    # HAProxy's files in our folder too (Ray's default is /tmp/haproxy-serve), so that _stop finds it
    hap = Path(f"/tmp/llmc-hap404-{os.getpid()}")  # short: a unix socket's path has 107 bytes
    env |= {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(hap / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(hap / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(hap),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(hap / "server-state"),
    }
    head = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={free_port()}",
        f"--dashboard-port={dash}",
    ]
    head += [
        "--num-cpus=4",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--temp-dir={folder / 'ray'}",
    ]
    ray = subprocess.Popen(head, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for(lambda: _answers(address + "/api/version"), 120, "Ray's dashboard")
        return _rehearse(folder, address, http_port, args.upgrades)
    finally:
        _stop(ray, (str(folder), str(hap)))


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(ray: subprocess.Popen[bytes], folders: tuple[str, ...]) -> None:
    """This script's Ray only (never `ray stop`, which would stop every Ray on the host): its
    process group, then any process still naming one of its folders (HAProxy's among them)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(ray.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        ray.wait(20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(ray.pid, signal.SIGKILL)
    for proc in psutil.process_iter(["cmdline"]):
        if any(f in part for part in proc.info["cmdline"] or () for f in folders):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)


def _rehearse(folder: Path, address: str, http_port: int, upgrades: int) -> int:
    _deploy(folder, address, http_port, 0)
    up_s = wait_for(lambda: _running(address), 180, "the app RUNNING")
    print(f"serving after {up_s:.1f} s", flush=True)
    clients = _Clients(f"http://127.0.0.1:{http_port}/v1/completions")
    time.sleep(3)
    windows = []
    for v in range(1, upgrades + 1):
        t0 = time.time()
        _deploy(folder, address, http_port, v)
        time.sleep(1)
        took = wait_for(lambda: _running(address), 180, "the app RUNNING")
        windows.append((t0, time.time()))
        print(f"upgrade {v}: RUNNING again {took:.1f} s after the deploy", flush=True)
        time.sleep(3)
    clients.finish()
    bad = [s for s in clients.seen if s[1] != 200]
    during = [s for s in bad if any(a <= s[0] <= b + 3 for a, b in windows)]
    print("statuses:", dict(collections.Counter(s[1] for s in clients.seen)))
    print(f"non-200 during the upgrades (+3 s): {len(during)}; outside: {len(bad) - len(during)}")
    for s in dict.fromkeys((s[1], s[2]) for s in bad):
        print("  ", s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
