"""The lab's node plan: the Ray nodes ``cluster lab`` starts on this machine, read from a rendered
RayService the way KubeRay reads it. Pure: a manifest in, plain data out; no Ray, no processes.

One Ray node per pod: the head, then each worker group's ``replicas`` pods. A node's ``ray start``
parameters are the group's ``rayStartParams`` plus what KubeRay adds from the pod
(``ray-operator/controllers/ray/common/pod.go``): ``num-cpus``, ``memory`` and ``num-gpus`` from
the container's limits, ``resources`` from the group's ``resources``, and on the head
``dashboard-host: 0.0.0.0`` and ``metrics-export-port: 8080`` when unset. Its environment is the
container's ``env`` (``secretKeyRef``s filled from the secrets the lab is given, paths under a
mounted volume moved to a folder of the lab's) plus what one machine needs where pods have one
each (``lab_env``). The Serve config is the manifest's ``serveConfigV2``, as is.

Every node lives in a network namespace of its own, on a bridge of the lab's and a private subnet
that exists only there; a client namespace on the same bridge is where requests come from.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from cluster.base import ConfigError
from cluster.json_types import JSON, JSONObject
from cluster.k8s.settings import quantity

LAB = "llmc-lab0"  # the bridge, and the prefix of every namespace: llmc-lab0-head, llmc-lab0-cpu-0, …
VETH_PREFIX = "llmcl0v"  # host ends of the veth pairs: llmcl0v0 (the client), llmcl0v1, …
PEER_PREFIX = "llmcl0p"  # their peers before they move into a namespace (and become eth0)
SUBNET = "10.213.0.0/24"  # private, on the lab's bridge only
ROOT = Path("/tmp/llmc-lab")  # short: Ray's and HAProxy's unix sockets live under it
TAG_ENV = "LLMC_LAB"  # every process of a lab node carries it: leftovers are found by it
CLIENT = "client"
FIRST_NODE_HOST = 10  # node i gets the subnet's address .10 + i; the client gets .2
GCS_PORT = 6379  # KubeRay's head: Ray's default GCS port
DASHBOARD_PORT = 8265


class LabError(ConfigError):
    """A manifest the lab cannot run, or a lab that cannot start as asked."""


@dataclass(frozen=True)
class LabNode:
    """One pod as a Ray node in a namespace (the client namespace has no group and no params)."""

    name: str
    group: str
    netns: str
    veth: str
    ip: str
    ray_params: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def head(self) -> bool:
        return self.group == "head"


@dataclass(frozen=True)
class LabPlan:
    client: LabNode
    nodes: tuple[LabNode, ...]
    serve_config: str  # spec.serveConfigV2, the text Serve deploys
    serve_port: int
    exclude_head_from_service: bool
    bridge: str = LAB
    subnet: str = SUBNET
    root: str = str(ROOT)

    @property
    def head(self) -> LabNode:
        return next(n for n in self.nodes if n.head)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{self.head.ray_params.get('port', GCS_PORT)}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.ip}:{self.head.ray_params.get('dashboard-port', DASHBOARD_PORT)}"

    def service_nodes(self) -> list[LabNode]:
        """The nodes a Kubernetes Service of the Serve port would spread clients over."""
        return [n for n in self.nodes if not (n.head and self.exclude_head_from_service)]

    def apps(self) -> list[str]:
        return [a["name"] for a in yaml.safe_load(self.serve_config)["applications"]]


# KubeRay's reading of a group --------------------------------------------------------------
def _container(group: Mapping[str, JSON]) -> Mapping[str, JSON]:
    container: Mapping[str, JSON] = group["template"]["spec"]["containers"][0]  # a YAML manifest's
    return container


def ray_params(group: Mapping[str, JSON], head: bool) -> dict[str, str]:
    """``ray start`` parameters of a group's pods: its ``rayStartParams`` plus KubeRay's defaults."""
    params = {k: str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    res = _container(group).get("resources") or {}
    limits = {**(res.get("requests") or {}), **(res.get("limits") or {})}
    if "num-cpus" not in params and "cpu" in limits:
        params["num-cpus"] = str(math.ceil(quantity(str(limits["cpu"]))))  # Quantity.Value() rounds up
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(int(quantity(str(limits["memory"]))))
    gpus = sum(int(quantity(str(v))) for k, v in limits.items() if k.endswith("gpu"))
    if "num-gpus" not in params and gpus:
        params["num-gpus"] = str(gpus)
    if group.get("resources") and "resources" not in params:
        params["resources"] = json.dumps({k: float(v) for k, v in group["resources"].items()})
    if head:
        params.setdefault("dashboard-host", "0.0.0.0")
        params.setdefault("metrics-export-port", "8080")
    return params


def pod_env(
    group: Mapping[str, JSON], secrets: Mapping[str, str], volumes: Mapping[str, str]
) -> dict[str, str]:
    """The container's env: values as they are, Secret keys from ``secrets`` (a missing optional
    one is left out, a missing required one is an error, as the kubelet refuses the pod), and a
    value under a mounted volume's path moved to that volume's folder (``volumes``: mount → folder)."""
    env: dict[str, str] = {}
    for e in _container(group).get("env") or []:
        name = e["name"]
        if "value" in e:
            env[name] = _moved(str(e["value"]), volumes)
            continue
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise LabError(f"env {name}: only values and secretKeyRef are supported in the lab")
        if ref["key"] in secrets:
            env[name] = secrets[ref["key"]]
        elif not ref.get("optional", False):
            key = ref["key"]
            raise LabError(f"env {name} needs the Secret key {key}: set {key} in the environment")
    return env


def _moved(value: str, volumes: Mapping[str, str]) -> str:
    for mount, folder in volumes.items():
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return folder + value[len(mount.rstrip("/")) :]
    return value


def volume_folders(group: Mapping[str, JSON], node_root: Path, shared_root: Path) -> dict[str, str]:
    """Mount path → the lab's folder for it: an emptyDir on disk is the node's own, a claim is one
    folder shared by every node (as a ReadWriteMany claim is); in-memory ones (/dev/shm) stay."""
    spec = group["template"]["spec"]
    by_name = {v["name"]: v for v in spec.get("volumes") or []}
    out: dict[str, str] = {}
    for m in _container(group).get("volumeMounts") or []:
        v = by_name.get(m["name"], {})
        if (v.get("emptyDir") or {}).get("medium") == "Memory":
            continue
        if "persistentVolumeClaim" in v:
            out[m["mountPath"]] = str(shared_root / "claims" / v["persistentVolumeClaim"]["claimName"])
        else:
            out[m["mountPath"]] = str(node_root / "volumes" / m["name"])
    return out


# The lab's own additions ---------------------------------------------------------------------
def lab_env(node: str, root: Path, repo: Path) -> dict[str, str]:
    """What running every pod on one machine needs beyond the pod's env: the tag that finds the
    node's processes, the project on the path (the image has it installed), one Ray token for
    the whole lab, and Serve's HAProxy files in a folder of the node's (a pod has its own /tmp;
    here Serve's defaults would be one file for every node). The config's location is the head's
    on every node, as a manifest gives every pod the same env: Serve's controller passes its own
    value to every node's HAProxy manager, which keeps its files under ``<that folder>/<node id>``,
    and the replicas put our error page there (deployments/haproxy_errors.py) from their own
    node's value; with one folder per node, they wrote nowhere and clients of a killed gateway got
    Ray's plain-text 500 page (14th rehearsal, 4 requests)."""
    hap = root / node / "hap"
    return {
        TAG_ENV: LAB,
        "PYTHONPATH": str(repo),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(root / "ray_auth_token"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(root / "head" / "hap" / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(hap / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(hap),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(hap / "server-state"),
        # Every node shares this machine's cores: Serve's 5 s ready check of a proxy is too short
        # while four nodes start at once (it killed the proxy on a loaded 2-core box).
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    }


def start_args(node: LabNode, plan: LabPlan) -> list[str]:
    """``ray start`` arguments of a node: KubeRay's (head or the head's address, ``--block`` as
    a pod's main process) with the node's own address and a temp folder of its own."""
    args = ["--head"] if node.head else [f"--address={plan.gcs_address}"]
    args += [
        f"--node-ip-address={node.ip}",
        f"--temp-dir={Path(plan.root) / node.name / 'ray'}",
        "--block",
        "--disable-usage-stats",
    ]
    for k, v in node.ray_params.items():
        args.append(f"--{k}" if v.lower() == "true" else f"--{k}={v}")
    return args


def make_plan(
    manifest: Mapping[str, JSON], secrets: Mapping[str, str], repo: Path, root: Path = ROOT
) -> LabPlan:
    """The lab of a rendered RayService: a namespace, an address and a Ray node per pod."""
    if manifest.get("kind") != "RayService":
        raise LabError(f"expected a RayService, got a {manifest.get('kind')}")
    spec = manifest["spec"]
    rc = spec["rayClusterConfig"]
    pods = [("head", rc["headGroupSpec"], 1)] + [
        (g["groupName"], g, int(g.get("replicas", g.get("minReplicas", 0)))) for g in rc["workerGroupSpecs"]
    ]
    net = ipaddress.ip_network(SUBNET)
    nodes: list[LabNode] = []
    for group, g, count in pods:
        for k in range(count):
            name = group if group == "head" else f"{group}-{k}"
            env = pod_env(g, secrets, volume_folders(g, root / name, root)) | lab_env(name, root, repo)
            i = len(nodes)
            if FIRST_NODE_HOST + i >= net.num_addresses - 1:
                raise LabError(f"{SUBNET} has no address left for pod {name}")
            veth, ip = f"{VETH_PREFIX}{i + 1}", str(net[FIRST_NODE_HOST + i])
            nodes.append(LabNode(name, group, f"{LAB}-{name}", veth, ip, ray_params(g, group == "head"), env))
    client = LabNode(CLIENT, "", f"{LAB}-{CLIENT}", f"{VETH_PREFIX}0", str(net[2]))
    serve = yaml.safe_load(spec["serveConfigV2"])
    return LabPlan(
        client=client,
        nodes=tuple(nodes),
        serve_config=spec["serveConfigV2"],
        serve_port=int((serve.get("http_options") or {}).get("port", 8000)),
        exclude_head_from_service=bool(spec.get("excludeHeadPodFromServeSvc", False)),
        root=str(root),
    )


def _offers(params: Mapping[str, str]) -> dict[str, float]:
    out = {"CPU": float(params.get("num-cpus", math.inf)), "GPU": float(params.get("num-gpus", 0))}
    if "memory" in params:
        out["memory"] = float(params["memory"])
    return out | {k: float(v) for k, v in json.loads(params.get("resources", "{}")).items()}


def _asks(actor: Mapping[str, JSON]) -> dict[str, float]:
    want = {"CPU": float(actor.get("num_cpus", 1)), "GPU": float(actor.get("num_gpus", 0))}
    if actor.get("memory"):
        want["memory"] = float(actor["memory"])
    return want | {k: float(v) for k, v in (actor.get("resources") or {}).items()}


def unplaceable(plan: LabPlan) -> list[str]:
    """Each deployment whose replica no lab node can hold (a GPU engine on this machine, a custom
    resource no group offers), in words; deployments the Serve config leaves to the code are not
    checked."""
    offers = [(n.name, _offers(n.ray_params)) for n in plan.nodes]
    out = []
    for app in yaml.safe_load(plan.serve_config)["applications"]:
        for d in app.get("deployments") or []:
            if "ray_actor_options" not in d:
                continue
            want = {k: v for k, v in _asks(d["ray_actor_options"]).items() if v > 0}
            if not any(all(have.get(k, 0.0) >= v for k, v in want.items()) for _, have in offers):
                asks = ", ".join(f"{k}={v:g}" for k, v in sorted(want.items()))
                out.append(f"{app['name']}/{d['name']} asks {asks}: no node of the lab offers that")
    return out


PIN_PREFIX = "llmc_pin_"  # the custom resource that pins a deployment to one pod: llmc_pin_engine_0


def pinned(plan: LabPlan, pins: Mapping[str, str]) -> LabPlan:
    """The plan with each deployment of ``pins`` (deployment name -> node name) held to that node:
    the node offers a resource of its own (``llmc_pin_<node>``) and the deployment's replicas ask
    for a sliver of it, as a worker group of its own with its custom resource would on Kubernetes
    (the lab's engine group is one group of identical pods). Nothing else of the Serve config changes."""
    by_name = {n.name: n for n in plan.nodes}
    doc = yaml.safe_load(plan.serve_config)
    wanted = dict(pins)
    for app in doc["applications"]:
        for d in app.get("deployments") or []:
            if (node := wanted.pop(d["name"], None)) is None:
                continue
            if node not in by_name:
                raise LabError(f"cannot pin {d['name']} to {node}: the lab has no such node")
            actor = d.setdefault("ray_actor_options", {})
            actor["resources"] = {**(actor.get("resources") or {}), _pin(node): 0.001}
    if wanted:
        raise LabError(f"cannot pin {sorted(wanted)}: no such deployment in the Serve config")
    nodes = []
    for n in plan.nodes:
        if n.name in pins.values():
            offers = json.loads(n.ray_params.get("resources", "{}")) | {_pin(n.name): 1000.0}
            n = replace(n, ray_params=n.ray_params | {"resources": json.dumps(offers)})
        nodes.append(n)
    return replace(plan, nodes=tuple(nodes), serve_config=yaml.safe_dump(doc, sort_keys=False))


def _pin(node: str) -> str:
    return PIN_PREFIX + node.replace("-", "_")


def gpus_needed(plan: LabPlan) -> dict[str, int]:
    """Node → the GPUs its pod asks for (its container's ``*gpu`` limits), for the nodes that ask:
    on a machine without them, such a pod would stay Pending in Kubernetes; the lab refuses it."""
    return {n.name: int(float(g)) for n in plan.nodes if float(g := n.ray_params.get("num-gpus", "0")) > 0}


# Names and state -----------------------------------------------------------------------------
def is_lab_netns(name: str) -> bool:
    return name.startswith(f"{LAB}-")


def is_lab_link(name: str) -> bool:
    return name == LAB or name.startswith((VETH_PREFIX, PEER_PREFIX))


def state_of(plan: LabPlan, source: Mapping[str, str]) -> JSONObject:
    """What ``cluster lab down`` and ``status`` need, written before anything is created."""
    return {
        "source": dict(source),
        "bridge": plan.bridge,
        "subnet": plan.subnet,
        "root": plan.root,
        "dashboard": plan.dashboard_url,
        "serve_port": plan.serve_port,
        "apps": plan.apps(),
        "client": asdict(plan.client),
        "nodes": [{k: v for k, v in asdict(n).items() if k != "env"} for n in plan.nodes],
        "pids": {},
    }
