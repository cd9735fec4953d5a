"""vLLM's side of tenant isolation (issue 47 item 2), on a real vLLM-CPU engine in this process
(our ``VLLMBackend``, the tiny local model, KV events on): a request's cache salt reaches vLLM's
prefix cache (the same prompt under another salt, or none, computes every token again; under its
own it hits), vLLM's ``BlockStored`` events carry the salt back, and the router's index, fed by
them, holds each group's blocks under that group's hashes, the ones the engine replica announces
in ``BlocksQueued`` and the gateway computes. The whole probe through a cluster:
``tests/integration/test_tenant_cache.py``."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from cluster.config import BackendConfig, EngineArgs, ModelConfig, TenantConfig, load_config
from cluster.engine.kv_events import BlocksQueued, BlockStored, KVCacheEvent, page_from_wire, page_to_wire
from cluster.routing.affinity import AffinityRouter
from cluster.routing.block_hash import BlockHasher
from cluster.routing.cache_salt import CacheSalts
from cluster.wire.protocol import GenerateRequest, Sampling
from deployments.launcher.local import scratch_env

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

BS = 32
PROMPT = [5 + (i * 7919) % 1500 for i in range(170)]  # 5 full blocks of 32
SALTS = CacheSalts([TenantConfig(name="tenant-a"), TenantConfig(name="tenant-b")], "a-secret-of-the-cluster")


@pytest.fixture(scope="module")
def backend_cfg() -> Iterator[tuple[BackendConfig, ModelConfig]]:
    local = load_config("configs/local.yaml")
    model = local.model("tiny-llama")
    assert model is not None
    env = {k: v for k, v in scratch_env().items() if not k.startswith(("RAY_", "LLMC_"))}
    cfg = BackendConfig(
        name="vllm-salt",
        kind="vllm",
        model="tiny-llama",
        engine=EngineArgs(
            block_size=BS, kv_cache_memory_bytes=16 * 2**20, enforce_eager=True, max_model_len=1024
        ),
        env={**local.backends[0].env, **env},
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cfg.env.items():
            mp.setenv(k, v)
        yield cfg, model


def _req(rid: str, salt: str | None) -> GenerateRequest:
    return GenerateRequest(rid, "tiny-llama", "completion", PROMPT, Sampling(max_tokens=1), cache_salt=salt)


async def _cached(backend, rid: str, salt: str | None) -> int:
    usage = None
    async for chunk in backend.generate(_req(rid, salt)):
        usage = chunk.usage or usage
    assert usage is not None
    return usage.cached_tokens


async def test_vllm_caches_per_salt_and_its_events_map_to_the_routers_salted_hashes(backend_cfg) -> None:
    from deployments.engine.kv_endpoint import KVEventEndpoint
    from deployments.engine.vllm_replica import VLLMBackend

    cfg, model = backend_cfg
    backend = VLLMBackend(cfg, model, "salt-0")
    a, b = SALTS.salt("tenant-a"), SALTS.salt("tenant-b")
    try:
        assert backend.kv_events is not None
        endpoint = KVEventEndpoint(backend.kv_events, "token", BlockHasher(BS, cfg.model))
        # vLLM's events as converted, before the replica's log keeps them in the router's hashes
        raw: list[KVCacheEvent] = []
        publish = backend.kv_events.translate
        assert publish is not None
        backend.kv_events.translate = lambda evs: publish(raw.extend(evs) or evs)
        endpoint.announce(_req("q", b))
        assert await _cached(backend, "b-1", b) == 0
        assert await _cached(backend, "b-2", b) >= 4 * BS  # its own group: the prefix cache as before
        assert await _cached(backend, "anon", None) == 0  # no tenant: vLLM finds none of b's blocks
        assert await _cached(backend, "a-1", a) == 0  # another tenant: nor does it
        assert await _cached(backend, "a-2", a) >= 4 * BS
        for _ in range(200):  # vLLM's publisher thread hands the last batches over
            events = list(raw)
            if sum(isinstance(e, BlockStored) and e.parent_block_hash is None for e in events) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        backend.shutdown()
        backend.engine = None  # dropped here, not at interpreter exit (where its __del__ fails)
        gc.collect()
    firsts = [e for e in events if isinstance(e, BlockStored) and e.parent_block_hash is None]
    assert {e.cache_salt for e in firsts} >= {a, b, None}, firsts  # vLLM's extra keys gave them back

    router = AffinityRouter(BS, cfg.model)
    router.apply_kv_page("r", page_from_wire(page_to_wire(backend.kv_events.since(0))), now=0.0)
    queued = next(e for e in events if isinstance(e, BlocksQueued))
    assert list(queued.block_hashes) == router.hash(
        PROMPT, b
    )  # the replica's announcement, the gateway's hashes
    bit = router.index.mask(["r"])
    for salt in (a, b, None):  # each group's blocks, under its own hashes
        assert router.index.longest_match(router.hash(PROMPT, salt), bit)[0] == len(PROMPT) // BS
    never = SALTS.salt("tenant-c")  # a group that sent nothing holds nothing
    assert router.index.longest_match(router.hash(PROMPT, never), bit)[0] == 0
