"""The lab's node plan (``cluster/k8s/lab_plan.py``) and the manifest's engine group it reads: the
Ray nodes ``cluster lab`` starts are the RayService's pods as KubeRay starts them, with the pods'
own env, and the Serve config is the manifest's, as is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ConfigError, load_config
from cluster.dataplane import INTERNAL_TOKEN_ENV, SERVE_ENV
from cluster.k8s.lab_plan import (
    LAB,
    SUBNET,
    LabError,
    gpus_needed,
    is_lab_link,
    is_lab_netns,
    make_plan,
    pinned,
    pod_env,
    ray_params,
    start_args,
    state_of,
    unplaceable,
    volume_folders,
)
from cluster.k8s.rayservice import CPU_NODE_RESOURCE, ENGINE_NODE_RESOURCE, render_rayservice
from cluster.k8s.settings import load_settings
from tests.unit.test_k8s import deployments_of, groups_of, validate_against_crd, validate_k8s

ROOT = Path(__file__).resolve().parents[2]
SECRET = {"LLMC_INTERNAL_TOKEN": "s3cret-internal"}


def lab_manifest(config: str = "configs/sim-local.yaml") -> dict[str, Any]:
    return render_rayservice(load_config(ROOT / config), load_settings(ROOT / "k8s/settings/lab.yaml"))


def test_engine_group_holds_the_engines_apart_from_the_gateways() -> None:
    rs = lab_manifest("configs/cpu-dev.yaml")
    groups = groups_of(rs)
    assert list(groups) == ["cpu", "engine"]
    assert groups["engine"]["resources"] == {ENGINE_NODE_RESOURCE: "1000"}
    assert (groups["engine"]["minReplicas"], groups["engine"]["maxReplicas"]) == (2, 2)
    deps = deployments_of(rs)
    assert deps["Gateway"]["ray_actor_options"]["resources"] == {CPU_NODE_RESOURCE: 0.001}
    for name in ("backend-sim-llama-8b", "backend-sim-fallback"):
        assert deps[name]["ray_actor_options"]["resources"] == {ENGINE_NODE_RESOURCE: 0.001}, name
    validate_against_crd(rs)
    template = groups["engine"]["template"]
    validate_k8s(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "engine"}, "template": template}
    )


def test_engine_pods_carry_no_provider_key_and_cpu_pods_do() -> None:
    cfg = load_config(ROOT / "configs/gpu.yaml")
    s = load_settings(ROOT / "k8s/settings/gpu.yaml")
    s = s.model_copy(update={"engine": load_settings(ROOT / "k8s/settings/lab.yaml").engine})
    groups = groups_of(render_rayservice(cfg, s))
    keys = {b.provider.api_key_env for b in cfg.backends if b.provider and b.provider.api_key_env}
    assert keys

    def env_names(g: dict[str, Any]) -> set[str]:
        return {e["name"] for e in g["template"]["spec"]["containers"][0]["env"]}

    assert keys <= env_names(groups["cpu"])
    assert not keys & env_names(groups["engine"])
    assert INTERNAL_TOKEN_ENV in env_names(groups["engine"])


def test_an_engine_that_fits_no_engine_pod_is_refused() -> None:
    s = load_settings(ROOT / "k8s/settings/lab.yaml")
    cfg = load_config(ROOT / "configs/cpu-dev.yaml")
    big = cfg.backends[0].model_copy(
        update={"resources": cfg.backends[0].resources.model_copy(update={"num_cpus": 8})}
    )
    cfg = cfg.model_copy(update={"backends": [big, *cfg.backends[1:]]})
    with pytest.raises(ConfigError, match="does not fit one engine pod"):
        render_rayservice(cfg, s)


def test_the_plan_is_the_manifests_pods() -> None:
    plan = make_plan(lab_manifest(), SECRET, ROOT)
    assert [(n.name, n.group) for n in plan.nodes] == [
        ("head", "head"),
        ("cpu-0", "cpu"),
        ("engine-0", "engine"),
        ("engine-1", "engine"),
    ]
    ips = [plan.client.ip, *(n.ip for n in plan.nodes)]
    assert len(set(ips)) == len(ips) and all(ip.startswith("10.213.0.") for ip in ips)
    assert all(is_lab_netns(n.netns) and len(n.veth) <= 15 and is_lab_link(n.veth) for n in plan.nodes)
    head, cpu, eng = plan.nodes[0], plan.nodes[1], plan.nodes[2]
    assert head.ray_params["num-cpus"] == "0" and head.ray_params["dashboard-host"] == "0.0.0.0"
    assert json.loads(cpu.ray_params["resources"]) == {CPU_NODE_RESOURCE: 1000.0}
    assert json.loads(eng.ray_params["resources"]) == {ENGINE_NODE_RESOURCE: 1000.0}
    assert cpu.ray_params["num-cpus"] == "4" and cpu.ray_params["memory"] == str(4 * 2**30)
    for n in plan.nodes:  # the pod's env: Serve's data-plane settings and the credential, as is
        assert SERVE_ENV.items() <= n.env.items()
        assert n.env[INTERNAL_TOKEN_ENV] == SECRET["LLMC_INTERNAL_TOKEN"]
        assert n.env["LLMC_LAB"] == LAB and n.env["PYTHONPATH"] == str(ROOT)
    assert cpu.env["HF_HOME"].startswith(f"{plan.root}/cpu-0/")  # the pod's emptyDir: the node's own
    assert plan.serve_config == lab_manifest()["spec"]["serveConfigV2"]  # the text Serve gets
    assert plan.serve_port == 8000 and plan.apps() == ["llm-cluster-sim"]
    assert head not in plan.service_nodes() and len(plan.service_nodes()) == 3
    assert plan.gcs_address == f"{head.ip}:6379" and plan.dashboard_url == f"http://{head.ip}:8265"
    assert unplaceable(plan) == []


def test_start_args_are_kuberays() -> None:
    plan = make_plan(lab_manifest(), SECRET, ROOT)
    head, worker = plan.nodes[0], plan.nodes[3]
    h, w = start_args(head, plan), start_args(worker, plan)
    assert h[0] == "--head" and "--num-cpus=0" in h and "--dashboard-host=0.0.0.0" in h
    assert w[0] == f"--address={head.ip}:6379" and f"--node-ip-address={worker.ip}" in w
    assert "--block" in w and f"--temp-dir={plan.root}/engine-1/ray" in w
    assert '--resources={"llmc_engine_node": 1000.0}' in w


def test_ray_params_from_the_pod_as_kuberay_derives_them() -> None:
    group = {
        "rayStartParams": {"num-cpus": "3", "block": "true"},
        "resources": {"accel": "2"},
        "template": {
            "spec": {
                "containers": [
                    {"resources": {"limits": {"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": 2}}}
                ]
            }
        },
    }
    p = ray_params(group, head=False)
    assert p["num-cpus"] == "3"  # rayStartParams win
    assert p["memory"] == str(2 * 2**30) and p["num-gpus"] == "2"
    assert json.loads(p["resources"]) == {"accel": 2.0}
    assert "dashboard-host" not in p
    group["rayStartParams"] = {}
    assert ray_params(group, head=True)["num-cpus"] == "1"  # 500m rounds up, as Quantity.Value()
    assert ray_params(group, head=True)["metrics-export-port"] == "8080"


def test_pod_env_fills_secrets_and_refuses_a_missing_one() -> None:
    def group(*env: dict[str, Any]) -> dict[str, Any]:
        return {"template": {"spec": {"containers": [{"env": list(env)}]}}}

    ref = {"valueFrom": {"secretKeyRef": {"name": "s", "key": "K"}}}
    assert pod_env(group({"name": "A", **ref}), {"K": "v"}, {}) == {"A": "v"}
    with pytest.raises(LabError, match="Secret key K"):
        pod_env(group({"name": "A", **ref}), {}, {})
    optional = {"valueFrom": {"secretKeyRef": {"name": "s", "key": "K", "optional": True}}}
    assert pod_env(group({"name": "A", **optional}), {}, {}) == {}
    moved = pod_env(group({"name": "H", "value": "/m/x"}), {}, {"/m": "/lab/n/volumes/m"})
    assert moved == {"H": "/lab/n/volumes/m/x"}
    with pytest.raises(LabError, match="only values and secretKeyRef"):
        pod_env(group({"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}), {}, {})


def test_volume_folders() -> None:
    group = {
        "template": {
            "spec": {
                "containers": [
                    {
                        "volumeMounts": [
                            {"name": "dshm", "mountPath": "/dev/shm"},
                            {"name": "cache", "mountPath": "/c"},
                            {"name": "model", "mountPath": "/m"},
                        ]
                    }
                ],
                "volumes": [
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "cache", "emptyDir": {}},
                    {"name": "model", "persistentVolumeClaim": {"claimName": "models"}},
                ],
            }
        }
    }
    got = volume_folders(group, Path("/lab/n1"), Path("/lab"))
    assert got == {"/c": "/lab/n1/volumes/cache", "/m": "/lab/claims/models"}


def test_a_replica_no_node_offers_is_named() -> None:
    rs = lab_manifest()
    rc = rs["spec"]["rayClusterConfig"]
    rc["workerGroupSpecs"] = [g for g in rc["workerGroupSpecs"] if g["groupName"] != "engine"]
    bad = unplaceable(make_plan(rs, SECRET, ROOT))
    assert len(bad) == 1 and "backend-sim-h100" in bad[0] and ENGINE_NODE_RESOURCE in bad[0]


def test_a_deployment_pinned_to_a_node_asks_what_only_that_node_offers() -> None:
    plan = make_plan(lab_manifest("configs/cpu-dev.yaml"), SECRET, ROOT)
    pins = {"backend-sim-llama-8b": "engine-0", "backend-sim-fallback": "engine-1"}
    got = pinned(plan, pins)
    deps = {d["name"]: d for d in yaml.safe_load(got.serve_config)["applications"][0]["deployments"]}
    offers = {n.name: json.loads(n.ray_params.get("resources", "{}")) for n in got.nodes}
    for dep, node in pins.items():
        asks = deps[dep]["ray_actor_options"]["resources"]
        assert asks == {ENGINE_NODE_RESOURCE: 0.001, f"llmc_pin_{node.replace('-', '_')}": 0.001}
        holders = [n for n, have in offers.items() if all(have.get(k, 0) >= v for k, v in asks.items())]
        assert holders == [node], dep
    before = yaml.safe_load(plan.serve_config)["applications"][0]["deployments"]
    assert deps["Gateway"] == next(d for d in before if d["name"] == "Gateway")
    assert not unplaceable(got) and got.nodes[1] == plan.nodes[1]
    with pytest.raises(LabError, match="no such node"):
        pinned(plan, {"backend-sim-llama-8b": "engine-7"})
    with pytest.raises(LabError, match="no such deployment"):
        pinned(plan, {"backend-nope": "engine-0"})


def test_the_state_has_no_secret() -> None:
    plan = make_plan(lab_manifest(), SECRET, ROOT)
    state = state_of(plan, {"config": "c", "settings": "s"})
    text = json.dumps(state)
    assert SECRET["LLMC_INTERNAL_TOKEN"] not in text
    assert state["subnet"] == SUBNET and len(state["nodes"]) == 4
    assert yaml.safe_load(plan.serve_config)["applications"][0]["name"] == state["apps"][0]


def test_a_manifest_that_is_not_a_rayservice_is_refused() -> None:
    with pytest.raises(LabError, match="RayService"):
        make_plan({"kind": "RayCluster"}, SECRET, ROOT)


def test_gpu_pods_are_counted_for_the_machine_to_refuse() -> None:
    """configs/gpu.yaml's vLLM replicas ask for GPUs: the lab sees each GPU pod's need (and refuses
    it on a machine without GPUs, as Kubernetes would leave such a pod Pending)."""
    secrets = {k: "x" for k in ("LLMC_INTERNAL_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
    cfg = load_config(ROOT / "configs/gpu.yaml")
    keys = {b.provider.api_key_env for b in cfg.backends if b.provider and b.provider.api_key_env}
    plan = make_plan(lab_manifest("configs/gpu.yaml"), secrets | dict.fromkeys(keys, "x"), ROOT)
    need = gpus_needed(plan)
    assert need and all(name.startswith("gpu-tp") and n >= 1 for name, n in need.items())
    assert gpus_needed(make_plan(lab_manifest(), SECRET, ROOT)) == {}


def test_the_rehearsals_vllm_node_config_pins_one_engine_kind_per_pod(tmp_path: Path) -> None:
    """``loadtest.benchmarks.rehearsal --vllm-node``: configs/local.yaml's vLLM-CPU backend beside the sim
    engines on one route and one model, each held to its own engine pod."""
    from loadtest.benchmarks import rehearsal

    cfg = rehearsal.rehearsal_config("http://10.213.0.2:18101/v1", vllm=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(path)
    model = config.models[0].name
    assert config.candidates(model, "agent")[:2] == [rehearsal.VLLM, rehearsal.SIM]
    assert {b.kind for b in config.backends} == {"vllm", "sim", "provider"}
    manifest = render_rayservice(config, load_settings(ROOT / "k8s/settings/lab.yaml"))
    plan = pinned(make_plan(manifest, SECRET | {rehearsal.KEY_ENV: "k"}, ROOT), rehearsal.VLLM_PINS)
    assert not unplaceable(plan) and rehearsal._model(plan) == model


def test_the_rehearsals_indexer_config_deploys_the_indexers_on_the_cpu_pods(tmp_path: Path) -> None:
    """``rehearsal --kv-index indexer`` (issue 42): the sim backend's events applied by two indexer
    shards; the lab's manifest lists them, and the plan places every replica."""
    from loadtest.benchmarks import rehearsal

    cfg = rehearsal.rehearsal_config("http://10.213.0.2:18101/v1", kv_index="indexer")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(path)
    sim = next(b for b in config.backends if b.name == rehearsal.SIM)
    assert (sim.affinity.kv_index, sim.affinity.indexer_shards) == ("indexer", 2)
    manifest = render_rayservice(config, load_settings(ROOT / "k8s/settings/lab.yaml"))
    deployments = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    assert {f"indexer-{rehearsal.SIM}-0", f"indexer-{rehearsal.SIM}-1"} <= {d["name"] for d in deployments}
    assert not unplaceable(make_plan(manifest, SECRET | {rehearsal.KEY_ENV: "k"}, ROOT))
