"""The planner's host-CPU bound (cluster/planner/host_cpu.py) and how a backend's config sets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config, parse_config
from cluster.engine.profiles import BatchShape, get_profile
from cluster.planner.host_cpu import HostBoundStepTime, HostCpu, backend_host
from cluster.planner.replica_model import ReplicaModel, Workload

ROOT = Path(__file__).resolve().parents[2]


def test_a_step_lasts_the_cpu_every_engine_asks_for_over_the_cores_left() -> None:
    host = HostCpu(
        cores=2, engines=2, engine_cores_per_step=1.5, serving_cpu_s_per_token=0.2e-3, background_cores=0.5
    )
    # 2 engines x (1.5 x 3 ms + 0.2 ms x 10 decodes) = 13 ms of CPU over 1.5 cores
    assert host.step_time(3e-3, 10) == pytest.approx(13e-3 / 1.5)
    assert host.binds(3e-3, 10)
    alone = HostCpu(cores=16, engines=1, engine_cores_per_step=1.0, serving_cpu_s_per_token=0.0)
    assert alone.step_time(3e-3, 10) == 3e-3 and not alone.binds(3e-3, 10)  # the engine's own step


def test_the_bound_wraps_a_profiles_step_time() -> None:
    bare = get_profile("cpu-tiny").step_time_model()
    host = HostCpu(cores=2, engines=2, engine_cores_per_step=1.0, serving_cpu_s_per_token=0.5e-3)
    shape = BatchShape(prefill_tokens=0, decode_tokens=8, kv_read_tokens=8 * 400, attn_pairs=8 * 400)
    t = bare.step_time(shape)
    assert HostBoundStepTime(bare, host).step_time(shape) == pytest.approx(2 * (t + 8 * 0.5e-3) / 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cores": 0, "engines": 1, "engine_cores_per_step": 1, "serving_cpu_s_per_token": 0},
        {"cores": 2, "engines": 0, "engine_cores_per_step": 1, "serving_cpu_s_per_token": 0},
        {"cores": 2, "engines": 1, "engine_cores_per_step": -1, "serving_cpu_s_per_token": 0},
        {
            "cores": 2,
            "engines": 1,
            "engine_cores_per_step": 1,
            "serving_cpu_s_per_token": 0,
            "background_cores": 2,
        },
    ],
)
def test_impossible_hosts_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HostCpu(**kwargs)


def test_a_shared_host_slows_the_replica_and_names_itself_the_bound() -> None:
    profile, w = get_profile("cpu-tiny"), Workload(input_mean=400, output_mean=64)
    free = ReplicaModel(profile, w)
    shared = ReplicaModel(profile, w, HostCpu(2, 2, 1.4, 0.18e-3, 0.5))
    assert shared.itl(16) > 2 * free.itl(16) and shared.throughput(16) < free.throughput(16) / 2
    assert shared.regime(16) == "host CPU" and free.regime(16) == "compute"
    assert shared.max_batch() == free.max_batch()  # what fits is the engine's; how fast is the host's


def test_a_backend_config_sets_the_host_and_bad_values_name_the_field() -> None:
    raw = load_config(ROOT / "configs" / "local.yaml").model_dump(mode="json")
    backend = parse_config(raw).backends[0]
    host = backend_host(backend)
    assert host is not None and host.engines == backend.replicas == 2 and host.cores == 2
    raw["backends"][0].pop("host_cpu")
    assert backend_host(parse_config(raw).backends[0]) is None  # no host term: GPUs
    raw["backends"][0]["host_cpu"] = {
        "cores": 2,
        "engine_cores_per_step": 1,
        "serving_cpu_ms_per_token": 0.1,
        "background_cores": 3,
    }
    with pytest.raises(ConfigError, match="background_cores"):
        parse_config(raw)
    raw["backends"][0]["host_cpu"] = {
        "cores": -1,
        "engine_cores_per_step": 1,
        "serving_cpu_ms_per_token": 0.1,
    }
    with pytest.raises(ConfigError, match="cores"):
        parse_config(raw)


def test_a_requests_own_cost_is_spread_over_its_answer() -> None:
    host = HostCpu(2, 2, 1.0, 0.2e-3, 0.5, serving_cpu_s_per_request=6e-3)
    assert host.for_output(60).serving_cpu_s_per_token == pytest.approx(0.3e-3)  # 0.2 + 6/60 ms
    assert host.for_output(60).serving_cpu_s_per_request == 0.0  # folded in, not counted twice
    short, long_ = (ReplicaModel(get_profile("cpu-tiny"), Workload(400, o), host) for o in (8, 256))
    assert short.host is not None and long_.host is not None
    assert short.host.serving_cpu_s_per_token > long_.host.serving_cpu_s_per_token
