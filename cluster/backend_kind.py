"""What serves a backend's requests (``BackendConfig.kind``), and what each kind can do.

The code asks a kind's capabilities (``b.kind.caps.engine_replicas``), not its name: a switch on
``kind == "provider"`` said "no engine replicas" in one place and "no migration" in another, and
a new kind had to be found in every one of them. The enum is a ``StrEnum``: configs, JSON and
metrics labels still read ``vllm``, ``sim``, ``provider``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class KindCaps:
    """What a backend kind can do."""

    engine_replicas: bool  # replicas the app deploys, fed by the cache-aware view (else a provider API)
    profiled: bool  # its KV block size and step times come from an engine profile (the simulated engine)
    gpus: bool  # may be placed on GPUs (the RayService's GPU worker group)
    warm_up_by_default: bool  # an engine that compiles and captures on its first requests: warm it up
    migratable: bool  # a stream can continue on another replica from the tokens already sent


class BackendKind(StrEnum):
    VLLM = "vllm"
    SIM = "sim"
    PROVIDER = "provider"

    @property
    def caps(self) -> KindCaps:
        return _CAPS[self]


_CAPS = {
    BackendKind.VLLM: KindCaps(
        engine_replicas=True, profiled=False, gpus=True, warm_up_by_default=True, migratable=True
    ),
    BackendKind.SIM: KindCaps(
        engine_replicas=True, profiled=True, gpus=False, warm_up_by_default=False, migratable=True
    ),
    BackendKind.PROVIDER: KindCaps(
        engine_replicas=False, profiled=False, gpus=False, warm_up_by_default=False, migratable=False
    ),
}
