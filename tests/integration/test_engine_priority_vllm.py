"""Priority reaches vLLM's scheduler: a real vLLM-CPU engine (in this process, through our
``VLLMBackend``, the tiny local model) with a batch of two seats full of Agent work, three Agent
requests waiting, then a Tab request: the engine's own waiting count shows the queue before Tab
arrives, and Tab's first token comes before any waiting Agent request's."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from cluster.config import BackendConfig, EngineArgs, load_config
from cluster.wire.protocol import GenerateRequest, Sampling
from deployments.launcher.local import scratch_env

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

AGENT, TAB = 2, 0
SEATS = 2
WAITING = 3


@pytest.fixture(scope="module")
def backend_cfg() -> Iterator[tuple[BackendConfig, object]]:
    local = load_config("configs/local.yaml")
    model = local.model("tiny-llama")
    base = local.backends[0]
    env = {k: v for k, v in scratch_env().items() if not k.startswith(("RAY_", "LLMC_"))}
    cfg = BackendConfig(
        name="vllm-priority",
        kind="vllm",
        model="tiny-llama",
        engine=EngineArgs(
            block_size=32,
            kv_cache_memory_bytes=16 * 2**20,
            enforce_eager=True,
            max_num_seqs=SEATS,
            max_model_len=1024,
            scheduling_policy="priority",
        ),
        env={**base.env, **env},
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cfg.env.items():
            mp.setenv(k, v)
        yield cfg, model


def _req(rid: str, prompt: list[int], max_tokens: int, priority: int) -> GenerateRequest:
    sampling = Sampling(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return GenerateRequest(rid, "tiny-llama", "completion", prompt, sampling, priority=priority)


async def _until(pred: object, limit_s: float = 60.0) -> None:
    """Wait for a condition of the engine's own state (bounded, so nothing hangs)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred() and loop.time() < end:  # type: ignore[operator]
        await asyncio.sleep(0.005)


async def test_tab_is_scheduled_before_waiting_agent_work(backend_cfg: tuple[BackendConfig, object]) -> None:
    from deployments.engine.vllm_replica import VLLMBackend

    cfg, model = backend_cfg
    backend = VLLMBackend(cfg, model, "prio-0")  # type: ignore[arg-type]
    firsts: list[str] = []

    async def consume(req: GenerateRequest) -> None:
        async for chunk in backend.generate(req):
            if chunk.token_ids and req.request_id not in firsts:
                firsts.append(req.request_id)

    try:
        # The two seats: Agent streams long enough to outlast the queue's set-up.
        tasks = [
            asyncio.create_task(consume(_req(f"agent-run-{i}", [5 + i] * 200, 250 + 100 * i, AGENT)))
            for i in range(SEATS)
        ]
        await _until(lambda: len(firsts) == SEATS)
        assert len(firsts) == SEATS and backend.stats().running == SEATS
        tasks += [
            asyncio.create_task(consume(_req(f"agent-wait-{i}", [40 + i] * 64, 8, AGENT)))
            for i in range(WAITING)
        ]
        await _until(lambda: backend.stats().waiting == WAITING)
        assert backend.stats().waiting == WAITING  # the engine's own queue, before Tab arrives
        assert not any(f.startswith("agent-wait") for f in firsts)
        tasks.append(asyncio.create_task(consume(_req("tab", [90] * 16, 4, TAB))))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    finally:
        backend.shutdown()
        backend.engine = None  # dropped here, not at interpreter exit (where its __del__ fails)
        gc.collect()
    waiting_firsts = [firsts.index(f"agent-wait-{i}") for i in range(WAITING)]
    assert firsts.index("tab") < min(waiting_firsts), firsts
