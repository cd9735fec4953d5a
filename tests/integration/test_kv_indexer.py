"""Issue 42's indexer design on a real Serve app (``affinity.kv_index: indexer``): two indexer
shards apply the simulated engines' KV events once, the gateway mirrors their frames; a shared
prefix lands on its holder and hits, and an indexer killed as a crash is replaced and re-read
(a new run: the gateway takes its snapshot) while routing goes on."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from cluster.config import load_config
from fixtures.replicas import kill_replica

pytestmark = pytest.mark.integration

MODEL = "sim-llama-8b"
PREFIX = " ".join(f"def indexed_{i}(x): return x * {i}" for i in range(80))  # ~1.2k tokens


@pytest.fixture(scope="module")
def ix(deploy):
    cfg = load_config("configs/sim-local.yaml")
    data = cfg.model_dump(mode="json", exclude_unset=True)
    data["name"] = "llm-cluster-sim-ix"
    b = data["backends"][0]
    b["replicas"] = 2
    b["affinity"] = {"kv_index": "indexer", "indexer_shards": 2}
    return deploy(type(cfg).model_validate(data), route_prefix="/ix")


def _chat(ix, content: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": content}],
        "max_tokens": 4,
    }
    return httpx.post(ix.base_url + "/chat/completions", json=body, timeout=60)


def _index(ix) -> dict:
    return ix.status()["routing"]["sim-h100"]["kv_index"]


def _until(ix, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    idx = _index(ix)
    while not pred(idx) and time.monotonic() < deadline:
        time.sleep(0.2)
        idx = _index(ix)
    assert pred(idx), idx
    return idx


def test_the_mirror_holds_what_the_engines_cached_and_routes_to_it(ix) -> None:
    first = _chat(ix, "question zero")
    assert first.status_code == 200, first.text
    holder = first.headers["x-llmc-replica"]
    idx = _until(ix, lambda i: i["replicas"].get(holder, {}).get("blocks", 0) >= 1000 // 16)
    feed = idx["feed"]
    assert len(feed["indexers"]) == 2 and all(s["epoch"] for s in feed["indexers"]), feed
    assert feed["frames"] > 0 and feed["snapshots"] >= 2, feed  # each shard read once, then followed
    for i in range(4):
        r = _chat(ix, f"question {i + 1}")
        assert r.status_code == 200, r.text
        assert r.headers["x-llmc-replica"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000


def _indexer_replica(app: str, deployment: str) -> str:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return next(n[len(prefix) :] for n in names if n.startswith(prefix))


def test_a_killed_indexer_is_replaced_and_read_again(ix) -> None:
    before = _index(ix)["feed"]
    kill_replica(ix.cfg.name, "indexer-sim-h100-0", _indexer_replica(ix.cfg.name, "indexer-sim-h100-0"))
    r = _chat(ix, "while an indexer restarts")  # routing goes on: the mirror as it was
    assert r.status_code == 200, r.text
    old = before["indexers"][0]["epoch"]
    idx = _until(ix, lambda i: i["feed"]["indexers"][0]["epoch"] not in (None, old), timeout=60)
    assert idx["feed"]["snapshots"] > before["snapshots"], idx["feed"]
    holder = r.headers["x-llmc-replica"]
    # the new run rebuilt shard 0 from the engines' logs: the holder's blocks are back in the mirror
    _until(ix, lambda i: i["replicas"].get(holder, {}).get("blocks", 0) >= 1000 // 16)
    again = _chat(ix, "after the restart")
    assert again.status_code == 200 and again.headers["x-llmc-replica"] == holder
