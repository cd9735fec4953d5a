"""The deploy settings the KubeRay manifests need beyond the cluster config (image, pod sizes,
node selectors, upgrade strategy, Serve options), validated like the config: unknown keys are
errors naming the field. Kubernetes quantities (``500m``, ``16Gi``) are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from cluster.base import Strict, read_yaml, validate
from cluster.json_types import JSONObject

_IMAGE = re.compile(r"^(?P<repo>[^@\s]+?)(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@sha256:[0-9a-f]{64})?$")
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$|^[1-9][0-9]*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


_QUANTITY = re.compile(r"^([0-9.]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
_FACTORS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "Ki": 2**10,
    "M": 1e6,
    "Mi": 2**20,
    "G": 1e9,
    "Gi": 2**30,
    "T": 1e12,
    "Ti": 2**40,
}


def quantity(q: str) -> float:
    """A Kubernetes quantity ('500m', '16Gi', '8') as a number."""
    m = _QUANTITY.match(q)
    if m is None:
        raise ValueError(f"'{q}' is not a Kubernetes quantity this renderer understands")
    return float(m[1]) * _FACTORS[m[2]]


# Settings ------------------------------------------------------------------------------------
class PodSettings(Strict):
    cpu: str = Field(description="CPU of the Ray container (request = limit: Guaranteed QoS).")
    memory: str = Field(description="Memory of the Ray container (request = limit), /dev/shm included.")
    shm_size: str = Field("2Gi", description="In-memory /dev/shm; Ray's object store takes half of it.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[JSONObject] = Field(default_factory=list, description="Pod tolerations.")

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantity(cls, v: str) -> str:
        quantity(v)
        return v

    @model_validator(mode="after")
    def _shm_fits(self) -> PodSettings:
        if quantity(self.shm_size) >= quantity(self.memory):
            raise ValueError(
                f"shm_size ({self.shm_size}) counts against memory ({self.memory}): make it smaller"
            )
        return self


class HeadSettings(PodSettings):
    cpu: str = Field("4", description="CPU of the head's Ray container.")
    memory: str = Field("16Gi", description="Memory of the head's Ray container.")


class CpuGroupSettings(PodSettings):
    cpu: str = Field("8", description="CPU of one cpu-group pod.")
    memory: str = Field("16Gi", description="Memory of one cpu-group pod.")
    min_replicas: int = Field(1, ge=0, description="Fewest cpu-group pods.")
    max_replicas: int = Field(4, ge=1, description="Most cpu-group pods.")

    @model_validator(mode="after")
    def _bounds(self) -> CpuGroupSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("cpu.min_replicas must not exceed cpu.max_replicas")
        return self


class GpuGroupSettings(PodSettings):
    cpu: str = Field("8", description="CPU of one GPU pod (one vLLM replica).")
    memory: str = Field("96Gi", description="Memory of one GPU pod, the /dev/shm volume included.")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of the GPUs.")
    shm_size: str = Field(
        "16Gi", description="In-memory /dev/shm (NCCL, vLLM workers); Ray's object store: half."
    )
    model_cache_claim: str = Field("llm-model-cache", description="PVC holding the Hugging Face cache.")
    model_cache_path: str = Field(
        "/home/ray/.cache/huggingface", description="Where it is mounted (HF_HOME)."
    )
    tolerations: list[JSONObject] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Pod tolerations (default: the usual taint on GPU nodes).",
    )


class EngineGroupSettings(PodSettings):
    """Pods of their own for the engines that use no GPU (simulated ones, vLLM's CPU build), apart
    from the gateways' cpu pods, as GPU pods hold the GPU engines."""

    cpu: str = Field("8", description="CPU of one engine pod.")
    memory: str = Field("16Gi", description="Memory of one engine pod, the /dev/shm volume included.")
    min_replicas: int = Field(1, ge=0, description="Fewest engine pods.")
    max_replicas: int = Field(4, ge=1, description="Most engine pods.")

    @model_validator(mode="after")
    def _bounds(self) -> EngineGroupSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("engine.min_replicas must not exceed engine.max_replicas")
        return self


class UpgradeSettings(Strict):
    type: Literal["NewCluster", "None", "NewClusterWithIncrementalUpgrade"] = Field(
        "NewCluster",
        description="KubeRay upgradeStrategy.type for rayClusterConfig changes (see k8s/README.md).",
    )
    gateway_class_name: str | None = Field(None, description="Gateway API class (incremental upgrade only).")
    step_size_percent: int | None = Field(
        None, ge=1, le=100, description="Traffic moved per step (incremental)."
    )
    interval_seconds: int | None = Field(None, ge=1, description="Seconds between steps (incremental).")
    max_surge_percent: int | None = Field(
        None, ge=1, le=100, description="Capacity added per step (incremental)."
    )
    cluster_deletion_delay_seconds: int | None = Field(
        None, ge=0, description="Keep the old RayCluster this long after a switch (KubeRay default 60)."
    )

    @model_validator(mode="after")
    def _incremental(self) -> UpgradeSettings:
        incremental = self.type == "NewClusterWithIncrementalUpgrade"
        given = [self.gateway_class_name, self.step_size_percent, self.interval_seconds]
        if incremental and any(v is None for v in given):
            raise ValueError(
                "upgrade: NewClusterWithIncrementalUpgrade needs gateway_class_name, step_size_percent "
                "and interval_seconds"
            )
        if not incremental and any(v is not None for v in [*given, self.max_surge_percent]):
            raise ValueError(
                "upgrade: gateway/step/interval/surge options are only for the incremental upgrade"
            )
        if incremental and (self.step_size_percent or 0) > (self.max_surge_percent or 100):
            raise ValueError("upgrade.step_size_percent must not exceed upgrade.max_surge_percent")
        return self


class AutoscalerSettings(Strict):
    version: Literal["v1", "v2"] = Field("v2", description="Ray autoscaler version.")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = Field(
        "Default", description="How fast the autoscaler adds pods."
    )
    idle_timeout_seconds: int = Field(300, ge=0, description="Idle time before a worker pod is removed.")
    cpu: str = Field("500m", description="CPU of the autoscaler sidecar (request = limit).")
    memory: str = Field("1Gi", description="Memory of the autoscaler sidecar (request = limit).")


class ServeSettings(Strict):
    gateway_num_cpus: float = Field(
        1.0, ge=0, description="Ray CPUs per Gateway replica (it tokenizes and relays every token)."
    )
    upscale_delay_s: float | None = Field(
        None, ge=0, description="Serve upscale delay for autoscaled backends."
    )
    downscale_delay_s: float | None = Field(
        None,
        ge=0,
        description="Serve downscale delay for autoscaled backends (a vLLM replica is slow to start).",
    )
    graceful_shutdown_timeout_s: float | None = Field(
        None, ge=0, description="Time a stopping replica gets to finish its streams (Serve default 20 s)."
    )
    log_encoding: Literal["TEXT", "JSON"] = Field("JSON", description="Serve log format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Serve log level.")


class K8sSettings(Strict):
    name: str = Field("llm-cluster", description="RayService name (a DNS-1035 label, at most 47 characters).")
    namespace: str | None = Field(None, description="metadata.namespace (None: set by kustomize/kubectl).")
    image: str = Field(description="The project image with a pinned tag or digest (never latest).")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of every container."
    )
    ray_version: str = Field("2.60.0", description="Ray version in the image (rayClusterConfig.rayVersion).")
    internal_token_key: str | None = Field(
        "LLMC_INTERNAL_TOKEN",
        description="Key in the Secret holding the gateway-to-engine credential (None: Ray's auth token).",
    )
    secret_name: str = Field("llm-cluster-secrets", description="Secret with provider API keys and HF_TOKEN.")
    hf_token_key: str | None = Field(
        "HF_TOKEN",
        description="Secret key exported as HF_TOKEN (optional in the Secret); None: not exported.",
    )
    initializing_timeout: str = Field(
        "45m",
        description="ray.io/initializing-timeout: give up a first deployment that is not ready by then.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on the RayService and pods."
    )
    head: HeadSettings = Field(default_factory=HeadSettings, description="Head pod.")
    cpu: CpuGroupSettings = Field(default_factory=CpuGroupSettings, description="CPU worker group.")
    gpu: GpuGroupSettings = Field(default_factory=GpuGroupSettings, description="GPU worker groups.")
    engine: EngineGroupSettings | None = Field(
        None,
        description="A worker group for the engines that use no GPU (sim, vLLM-CPU); None: on cpu pods.",
    )
    upgrade: UpgradeSettings = Field(default_factory=UpgradeSettings, description="Upgrade strategy.")
    autoscaler: AutoscalerSettings = Field(default_factory=AutoscalerSettings, description="Ray autoscaler.")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="Serve deployment options.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > 47 or not _DNS1035.match(v):
            raise ValueError("must be a DNS-1035 label of at most 47 characters (KubeRay's limit)")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        m = _IMAGE.match(v)
        if m is None or (m["tag"] is None and "@sha256:" not in v):
            raise ValueError(f"'{v}': pin the image with a tag or a digest")
        if m["tag"] == "latest":
            raise ValueError(f"'{v}': 'latest' is not a pin")
        return v

    @field_validator("initializing_timeout")
    @classmethod
    def _timeout(cls, v: str) -> str:
        if not _DURATION.match(v):
            raise ValueError("a Go duration ('45m', '1h30m') or whole seconds")
        return v


def load_settings(path: str | Path) -> K8sSettings:
    raw = read_yaml(path)
    return validate(K8sSettings, raw or {}, str(Path(path)), "k8s settings")
