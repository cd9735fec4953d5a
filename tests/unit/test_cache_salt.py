"""Tenant isolation of the prefix caches (issue 47 item 2): the salts, the salted block hashes,
the simulated engine's salted cache and KV events, and the routing index fed by them. The
two-guess probe on the pure parts: another tenant's right guess looks like its wrong one."""

from __future__ import annotations

import random
import re

import pytest

from cluster.config import TenantConfig
from cluster.engine.kv import hash_block_tokens, hash_request_tokens, salt_keys, salt_of
from cluster.engine.kv_events import (
    BlocksQueued,
    BlockStored,
    FeedCursor,
    KVEventLog,
    event_to_wire,
    page_from_wire,
    page_to_wire,
)
from cluster.engine.model import EngineModel, SimRequest
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.block_hash import BlockHasher
from cluster.routing.cache_salt import CacheSalts, derive_salt, group_key, salted_session
from cluster.routing.view import BackendView, ReplicaInfo
from deployments.engine.vllm_kv_events import stored_salt
from tests.unit.test_kv_events import BS, profile

SECRET = "internal-credential-0123456789abcdef"


def salts(*tenants: TenantConfig) -> CacheSalts:
    return CacheSalts(list(tenants), SECRET)


def toks(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(5, 2000) for _ in range(n)]


# The salts ---------------------------------------------------------------------------------------


def test_no_tenant_is_unsalted_and_each_tenant_is_a_group_of_its_own() -> None:
    s = salts(TenantConfig(name="a"), TenantConfig(name="b"))
    assert s.salt(None) is None
    a, b = s.salt("a"), s.salt("b")
    assert a and b and a != b
    assert s.salt("a") == a  # stable: every gateway replica derives the same one
    assert re.fullmatch(r"[0-9a-f]{32}", a)  # vLLM takes it: <= 128 chars, no '@', '/', '\\'


def test_a_configured_group_shares_and_is_no_tenant_s_own() -> None:
    s = salts(
        TenantConfig(name="a", cache_group="partners"),
        TenantConfig(name="c", cache_group="partners"),
        TenantConfig(name="partners"),  # a tenant named like the group does not join it
        TenantConfig(name="b"),
    )
    assert s.salt("a") == s.salt("c")
    assert len({s.salt("a"), s.salt("partners"), s.salt("b")}) == 3


def test_the_salt_needs_the_secret() -> None:
    """Not the tenant's name, nor anything computed from it alone: another secret, another salt."""
    a = derive_salt(SECRET, group_key("tenant-b", None))
    assert "tenant-b" not in a
    assert a != derive_salt(SECRET + "x", group_key("tenant-b", None))
    with pytest.raises(ValueError):
        derive_salt("", group_key("tenant-b", None))


def test_sessions_live_in_their_group() -> None:
    assert salted_session("s1", None) == "s1"  # no tenant: the session id as the client sent it
    assert salted_session(None, "ab" * 16) is None
    assert salted_session("s1", "ab" * 16) != salted_session("s1", "cd" * 16)


# The router's hashes -----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["tuple", "blake2b"])
def test_no_salt_keeps_every_hash_and_a_salt_changes_every_block(algo: str) -> None:
    h = BlockHasher(16, "m", algo=algo)  # type: ignore[arg-type]
    t = toks(64)
    plain = h.hash_blocks(t)
    assert h.hash_blocks(t, salt=None) == plain == h.hash_blocks(t, salt="")  # single tenant: as before
    a, b = h.hash_blocks(t, salt="a" * 32), h.hash_blocks(t, salt="b" * 32)
    assert set(a).isdisjoint(plain) and set(a).isdisjoint(b) and len(a) == 4
    assert h.hash_blocks(t, salt="a" * 32) == a
    # A chain continued from a salted parent (the engine's later events) carries the salt.
    assert h.hash_blocks(t[32:], parent=a[1]) == a[2:]


# The simulated engine's cache and its events ------------------------------------------------------


def test_the_sim_salt_keys_the_first_block_and_the_chain_carries_it() -> None:
    t = toks(12)
    salted = hash_request_tokens(t, 4, salt_keys("s"))
    assert set(salted).isdisjoint(hash_request_tokens(t, 4)) and salt_of(salt_keys("s")) == "s"
    assert salt_keys(None) is None and hash_request_tokens(t, 4, salt_keys(None)) == hash_request_tokens(t, 4)
    grown = hash_request_tokens(t[:3], 4, salt_keys("s"))  # under a block at first: hashed as it grows
    assert hash_request_tokens(t, 4, salt_keys("s"), grown) == salted
    assert salted[1] == hash_block_tokens(salted[0], t[4:8])  # later blocks carry no key, as in vLLM


class Replica:
    """A simulated engine replica with its KV-event log (as SimBackend runs one)."""

    def __init__(self, name: str) -> None:
        self.name, self.n = name, 0
        self.log = KVEventLog(epoch=1)
        self.engine = EngineModel(profile(64), on_kv_events=lambda ev, end: self.log.append(ev, end))

    def serve(self, tokens: list[int], salt: str | None) -> SimRequest:
        """One request: announced as the engine replica announces it, then run."""
        self.log.append([BlocksQueued(BlockHasher(BS, "m").hash_blocks(tokens, salt=salt))], 0.0)
        self.n += 1
        req = self.engine.add_request(f"{self.name}-{self.n}", tokens, 2, extra_keys=salt_keys(salt))
        self.engine.run()
        return req


def test_the_sim_cache_answers_only_its_own_salt_and_its_events_say_which() -> None:
    r = Replica("a")
    t = toks(40)
    r.serve(t, "s1")
    stored = [e for b in r.log.since(0).batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].cache_salt == "s1"
    assert all(e.cache_salt is None for e in stored if e.parent_block_hash is not None)
    assert r.serve(t, "s2").num_cached_tokens == 0  # another group: nothing found
    assert r.serve(t, None).num_cached_tokens == 0  # nor without a tenant
    assert r.serve(t, "s1").num_cached_tokens >= 32  # its own group: the hit as before
    # The salt crosses the wire (and is left out of an unsalted event, as before).
    page = page_from_wire(page_to_wire(r.log.since(0)))
    salted = [e for b in page.batches for e in b.events if isinstance(e, BlockStored) and e.cache_salt]
    assert {e.cache_salt for e in salted} == {"s1", "s2"}
    plain = event_to_wire(BlockStored([1], None, [1, 2, 3, 4], 4))
    assert (
        "cache_salt" not in plain
        and event_to_wire(BlockStored([1], None, [1, 2, 3, 4], 4, "s1"))["cache_salt"] == "s1"
    )


# The probe, on the pure parts: engines, their events, one gateway's index ------------------------


def test_another_tenants_right_guess_looks_like_its_wrong_one() -> None:
    s = salts(TenantConfig(name="tenant-a"), TenantConfig(name="tenant-b"))
    replicas = [Replica("a"), Replica("b")]
    policy = AffinityRouter(BS, "m", AffinityParams(min_match_tokens=8))
    view = BackendView("sim", policy, ReplicaEjector(), 64)
    view.sync([ReplicaInfo(r.name, f"http://{r.name}", kv_events=True) for r in replicas])
    cursors = {r.name: FeedCursor() for r in replicas}

    def poll() -> None:
        for r in replicas:
            page = page_from_wire(page_to_wire(r.log.since(cursors[r.name].after, cursors[r.name].epoch)))
            view.apply_kv_page(r.name, page, now=0.0)
            cursors[r.name].advance(page)

    secret, wrong = toks(4, 1) + toks(40, 9), toks(4, 2) + toks(40, 9)  # the name in the first block
    replicas[0].serve(secret, s.salt("tenant-b"))
    poll()
    assert policy.index.held_blocks("a") >= 10  # the events were mapped to tenant-b's hashes
    for attacker in (None, "tenant-a"):
        salt = s.salt(attacker)
        right, miss = (view.choose(policy.hash(p, salt), 1.0) for p in (secret, wrong))
        assert right is not None and miss is not None
        assert (right.decision.reason, right.decision.matched_blocks, right.decision.best_blocks) == (
            miss.decision.reason,
            0,
            0,
        )
        assert right.decision.reason != "prefix"
        assert replicas[0].serve(secret, salt).num_cached_tokens == 0  # the engine finds nothing either
    owner = view.choose(policy.hash(secret, s.salt("tenant-b")), 1.0)
    assert owner is not None and owner.decision.reason == "prefix" and owner.replica == "a"
    assert replicas[0].serve(secret, s.salt("tenant-b")).num_cached_tokens >= 32  # its own hits stay


# vLLM's events -----------------------------------------------------------------------------------


def test_the_salt_is_read_out_of_vllms_extra_keys() -> None:
    salt = "f" * 32
    assert stored_salt([(salt,), None], None) == salt
    assert stored_salt([("lora-x", ("mm-1", 0), salt, b"\x00digest")], "lora-x") == salt
    assert stored_salt([("lora-x",)], "lora-x") is None  # a LoRA, no salt
    assert stored_salt(None, None) is None and stored_salt([None], None) is None


# The gateway's side: a request made ready under its tenant's salt ----------------------------------


@pytest.mark.parametrize("salt", [None, "ab" * 16])
def test_prepare_salts_the_request_its_hashes_and_its_session(salt: str | None) -> None:
    from pathlib import Path

    from cluster.config import load_config
    from cluster.wire.protocol import CompletionRequest
    from deployments.gateway.prepare import prepare

    cfg = load_config(Path(__file__).parents[2] / "configs" / "sim-local.yaml")
    model = cfg.models[0].name
    backend = cfg.candidates(model, "chat")[0]
    policy = AffinityRouter(16, model)
    views = {backend: BackendView(backend, policy, ReplicaEjector(), 64)}
    body = f'{{"model": "{model}", "prompt": "{"word " * 100}"}}'.encode()
    p = prepare(cfg, body, CompletionRequest, "completion", "r1", "chat", "sess-1", views, salt)
    ids = p.req.prompt_token_ids
    assert p.req.cache_salt == salt  # the engine gets it with the request
    assert p.hashes(backend) == policy.hash(ids, salt) and len(p.hashes(backend)) >= 4
    if salt is None:  # no tenant: hashes and session as before
        assert p.hashes(backend) == policy.hash(ids) and p.req.session_id == "sess-1"
    else:
        assert set(p.hashes(backend)).isdisjoint(policy.hash(ids)) and p.req.session_id != "sess-1"
