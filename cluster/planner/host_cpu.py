"""The host's CPU as a bound on an engine's steps, for engines that compute on the CPU they share
with their own serving stack (vLLM-CPU on a small box): the planner's host term. Pure.

An engine profile's step time is the engine alone with the host to itself (``calibrate_engine``
fits it so). Deployed, ``engines`` replicas on one host of ``cores`` cores each keep
``engine_cores_per_step`` cores busy while a step runs (vLLM-CPU's torch threads), every streamed
token costs ``serving_cpu_s_per_token`` of CPU outside the engine cores (the replica's HTTP stream,
detokenizing, the gateway's relay, HAProxy, a client on the same host), every request
``serving_cpu_s_per_request`` more (parsing, validating and routing its prompt in each process, its
connections; :meth:`HostCpu.for_output` folds it into the per-token cost of a workload whose
answers are ``O`` tokens long), and ``background_cores`` stay busy whatever the load (Ray's own
processes, the serving processes' loops). With the replicas
in step, a step then lasts at least the CPU all of them ask for, spread over the cores left::

    t = max(τ, engines · (engine_cores_per_step · τ + serving_cpu_s_per_token · D)
                / (cores - background_cores))

for a step of bare time ``τ`` that decodes ``D`` sequences (one streamed token each). On a GPU the
host's cores feed the GPU and this bound is far below the GPU's step: leave it out (no
``host_cpu`` in the backend's config). ``loadtest/calibration/calibrate_host.py`` measures the four costs from
``/proc`` on a workload of its own; BENCHMARKS.md (capacity planner) says how close the bound came
on this box and why not closer.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import BackendConfig
from cluster.engine.profiles import BatchShape, StepTimeModel


@dataclass(frozen=True, slots=True)
class HostCpu:
    cores: float
    engines: int
    engine_cores_per_step: float
    serving_cpu_s_per_token: float
    background_cores: float = 0.0
    serving_cpu_s_per_request: float = 0.0

    def for_output(self, output_tokens: float) -> HostCpu:
        """The same host with the per-request cost spread over a request's streamed tokens."""
        per_token = self.serving_cpu_s_per_token + self.serving_cpu_s_per_request / max(1.0, output_tokens)
        return HostCpu(self.cores, self.engines, self.engine_cores_per_step, per_token, self.background_cores)

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.engines < 1:
            raise ValueError("need cores > 0 and engines >= 1")
        costs = (self.engine_cores_per_step, self.serving_cpu_s_per_token, self.serving_cpu_s_per_request)
        if min(*costs, self.background_cores) < 0:
            raise ValueError("CPU costs cannot be negative")
        if self.background_cores >= self.cores:
            raise ValueError("background_cores must leave some of the cores")

    def step_time(self, bare_s: float, decodes: float) -> float:
        demand = self.engine_cores_per_step * bare_s + self.serving_cpu_s_per_token * decodes
        return max(bare_s, self.engines * demand / (self.cores - self.background_cores))

    def binds(self, bare_s: float, decodes: float) -> bool:
        """True when the host's CPU, not the engine's own step, sets this step's length."""
        return self.step_time(bare_s, decodes) > bare_s


@dataclass(frozen=True, slots=True)
class HostBoundStepTime:
    """An engine's step-time model with the host's CPU bound laid over it."""

    inner: StepTimeModel
    host: HostCpu

    def step_time(self, batch: BatchShape) -> float:
        return self.host.step_time(self.inner.step_time(batch), batch.decode_tokens)


def backend_host(backend: BackendConfig) -> HostCpu | None:
    """The host-CPU bound of a backend whose config describes its host (``host_cpu``): all of its
    replicas on that host. None: the engine's own step times stand (GPUs)."""
    h = backend.host_cpu
    if h is None:
        return None
    engines = backend.autoscaling.max_replicas if backend.autoscaling else backend.replicas
    return HostCpu(
        h.cores,
        engines,
        h.engine_cores_per_step,
        h.serving_cpu_ms_per_token / 1e3,
        h.background_cores,
        h.serving_cpu_ms_per_request / 1e3,
    )
