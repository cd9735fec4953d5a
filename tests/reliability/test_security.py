"""Security checks on the reliability app (auth on, keys stored as SHA-256): requests without a valid
API key get a 401 OpenAI error; the provider's key never reaches a client (not in errors, not even
when the provider echoes it, not in /v1/models or the OpenAPI document), Ray's logs or the metrics;
and a body over the limit gets its 413 before the client has sent it."""

from __future__ import annotations

import hashlib
import json
import socket
import time

import httpx
import pytest

from loadtest.common.actor_probe import find_in_logs, log_dir, metrics_text
from loadtest.common.reliability import CLAUDE, MIX, SIM_BACKEND, is_openai_error

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

OK_MSG = [{"role": "user", "content": "hi"}]


def _bodies() -> list[tuple[str, dict]]:
    return [
        ("/chat/completions", {"model": MIX, "messages": OK_MSG, "max_tokens": 2}),
        ("/completions", {"model": MIX, "prompt": "hi", "max_tokens": 2}),
    ]


def _credentials(rel) -> dict[str, dict[str, str]]:
    key = rel.keys.clients["chat"]
    return {
        "none": {},
        "empty": {"authorization": ""},
        "bearer-only": {"authorization": "Bearer"},
        "wrong": {"authorization": "Bearer sk-wrong-0123456789"},
        "basic": {"authorization": "Basic " + key},
        "no-scheme": {"authorization": key},
        "key-plus-one": {"authorization": f"Bearer {key}x"},
        "key-prefix": {"authorization": f"Bearer {key[:-1]}"},
        "the-hash": {"authorization": "Bearer " + hashlib.sha256(key.encode()).hexdigest()},
        "provider-key": {"authorization": f"Bearer {rel.keys.provider}"},
        "x-api-key": {"x-api-key": key},
    }


@pytest.mark.parametrize(
    "which",
    [
        "none",
        "empty",
        "bearer-only",
        "wrong",
        "basic",
        "no-scheme",
        "key-plus-one",
        "key-prefix",
        "the-hash",
        "provider-key",
        "x-api-key",
    ],
)
def test_requests_without_a_valid_key_get_401(rel, which) -> None:
    headers = _credentials(rel)[which]
    for path, body in _bodies():
        r = httpx.post(rel.base_url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (which, r.status_code, r.text)
        err = r.json()
        assert is_openai_error(err) and err["error"]["code"] == "invalid_api_key", err
        assert r.headers.get("x-request-id")
        presented = headers.get("authorization", "").removeprefix("Bearer").strip()
        assert not presented or presented not in r.text  # the credential is not echoed back


def test_a_valid_key_is_served_and_picks_its_surface(rel) -> None:
    for surface in ("chat", "agent"):
        path, body = _bodies()[0]
        r = httpx.post(rel.base_url + path, json=body, headers=rel.keys.headers(surface), timeout=60)
        assert r.status_code == 200, r.text
    # Under auth the key decides the surface: a header cannot promote a request to another one.
    r = httpx.post(
        rel.base_url + "/chat/completions",
        json={"model": MIX, "messages": OK_MSG, "max_tokens": 2},
        headers={**rel.keys.headers("agent"), "x-surface": "tab"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-llmc-backend"] == "rel-sim"  # agent's first choice


def test_models_needs_a_key(rel) -> None:
    for headers in ({}, {"authorization": "Bearer sk-wrong-0123456789"}):
        r = httpx.get(rel.base_url + "/models", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert is_openai_error(r.json()) and r.json()["error"]["code"] == "invalid_api_key"


def test_provider_key_not_in_models_or_openapi(rel) -> None:
    for url in (rel.base_url + "/models", rel.url + "/openapi.json"):
        r = httpx.get(url, headers=rel.keys.headers("chat"), timeout=30)
        assert r.status_code == 200
        assert rel.keys.provider not in r.text
        assert rel.keys.provider[-12:] not in r.text


@pytest.mark.parametrize(("model", "server"), [(MIX, "oai"), (CLAUDE, "ant")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_provider_error_that_echoes_our_key_is_scrubbed(rel, model, server, stream) -> None:
    getattr(rel, server).push_faults("echo_key")
    body = {"model": model, "messages": OK_MSG, "max_tokens": 2, "stream": stream}
    r = httpx.post(
        rel.base_url + "/chat/completions", json=body, headers=rel.keys.headers("chat"), timeout=60
    )
    assert rel.keys.provider not in r.text
    assert rel.keys.provider[4:] not in r.text  # nor most of it
    if r.status_code != 200:
        assert is_openai_error(r.json()), r.text


@pytest.mark.parametrize(("model", "server"), [(MIX, "oai"), (CLAUDE, "ant")])
def test_provider_refusing_our_key_is_a_502_without_the_key(rel, model, server) -> None:
    getattr(rel, server).push_faults("401")
    body = {"model": model, "messages": OK_MSG, "max_tokens": 2}
    r = httpx.post(
        rel.base_url + "/chat/completions", json=body, headers=rel.keys.headers("chat"), timeout=60
    )
    assert rel.keys.provider not in r.text
    if r.status_code != 200:  # rel-mix may have failed over to the simulated replicas
        err = r.json()
        assert is_openai_error(err) and r.status_code == 502, r.text
        assert err["error"]["code"] == "provider_auth_failed"


# -- 413 before the body is read whole -------------------------------------------------------------


def _read_response(sock: socket.socket, deadline: float) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n and time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _open(rel, path: str, headers: list[str]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", rel.cluster.port), timeout=10)
    head = f"POST {rel.cluster.route_prefix}/v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(h + "\r\n" for h in headers) + "\r\n"
    s.sendall(head.encode())
    return s


def test_declared_oversize_body_gets_413_before_it_is_sent(rel) -> None:
    """A huge Content-Length and a slow body: the 413 comes back after a few bytes, not at the end."""
    declared = 64 * 1024 * 1024
    s = _open(
        rel,
        "/chat/completions",
        [
            f"authorization: Bearer {rel.keys.clients['chat']}",
            "content-type: application/json",
            f"content-length: {declared}",
        ],
    )
    with s:
        s.sendall(b'{"model": "rel-mix", "messages": [')  # then nothing more
        status, headers, body = _read_response(s, time.monotonic() + 20)
    assert status == 413, body[:300]
    assert is_openai_error(json.loads(body)) and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers.get("x-request-id")


def test_chunked_slow_body_over_the_limit_gets_413_before_it_ends(rel) -> None:
    limit = rel.cluster.cfg.server.max_body_bytes
    s = _open(
        rel,
        "/chat/completions",
        [
            f"authorization: Bearer {rel.keys.clients['chat']}",
            "content-type: application/json",
            "transfer-encoding: chunked",
        ],
    )
    with s:
        piece = b"a" * 32768
        sent = 0
        while sent <= limit + len(piece):  # just past the limit, then the client goes quiet
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
        status, _, body = _read_response(s, time.monotonic() + 20)  # no terminating chunk was sent
    assert status == 413, body[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_unauthenticated_oversize_body_is_refused_without_reading_it(rel) -> None:
    s = _open(rel, "/chat/completions", ["content-type: application/json", "content-length: 1000000000"])
    with s:
        s.sendall(b"{")
        status, _, body = _read_response(s, time.monotonic() + 20)
    assert status in (401, 413), body[:300]
    assert is_openai_error(json.loads(body))


# -- issue 47 item 6: smaller leaks and rough edges ------------------------------------------------


def test_the_engines_token_ids_never_reach_the_client(rel) -> None:
    """The engines name each event's token ids in a ``: ids`` comment line (so the gateway can
    continue a broken stream elsewhere); the gateway keeps them: the client's stream has none."""
    body = {"model": MIX, "messages": OK_MSG, "max_tokens": 8, "stream": True}
    headers = rel.keys.headers("agent")  # the simulated replicas first
    with httpx.stream(
        "POST", rel.base_url + "/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        raw = b"".join(r.iter_bytes())
    assert r.status_code == 200 and r.headers["x-llmc-backend"] == SIM_BACKEND, raw[:300]
    assert raw.count(b"data: {") >= 2 and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    assert b": ids" not in raw and b"\n:" not in raw and not raw.startswith(b":"), raw[:300]


def test_an_overlong_request_id_is_refused_not_echoed(rel) -> None:
    """A 15 KB x-request-id came back whole in the response's headers: over 256 bytes it is an
    OpenAI 400 now (with an id of ours); up to 256 it is echoed as before. (5,000 bytes: a header
    near HAProxy's 16 KB buffer gets HAProxy's own 400 before the gateway.)"""
    body = {"model": MIX, "messages": OK_MSG, "max_tokens": 2}
    url = rel.base_url + "/chat/completions"
    long = "a" * 5_000
    r = httpx.post(url, json=body, headers={**rel.keys.headers("chat"), "x-request-id": long}, timeout=60)
    assert r.status_code == 400 and is_openai_error(r.json()), r.text[:300]
    assert r.json()["error"]["param"] == "x-request-id"
    ids = r.headers.get_list("x-request-id")
    assert len(ids) == 1 and len(ids[0]) <= 256 and long not in r.text
    ok = "b" * 256
    r = httpx.post(url, json=body, headers={**rel.keys.headers("chat"), "x-request-id": ok}, timeout=60)
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == [ok], r.text[:300]


def test_internal_status_without_the_credential_answers_as_an_unknown_path(rel) -> None:
    """It answered 404 ``model_not_found`` where an unknown path answers ``not_found`` (and a POST
    405): the path could be found. Now every answer is an unknown path's."""
    for method in ("GET", "POST"):
        unknown = httpx.request(method, rel.url + "/internal/nothing-here", timeout=30)
        for headers in ({}, {"x-llmc-internal": "0" * 64}):
            r = httpx.request(method, rel.url + "/internal/status", headers=headers, timeout=30)
            assert r.status_code == unknown.status_code == 404, r.text
            got, want = r.json()["error"], unknown.json()["error"]
            assert got == {**want, "message": want["message"].replace("nothing-here", "status")}, got
            assert got["code"] == "not_found"


def _raw_request(rel, path: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    s = socket.create_connection(("127.0.0.1", rel.cluster.port), timeout=10)
    with s:
        start = f"POST {rel.cluster.route_prefix}/v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        s.sendall(start + head + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        return _read_response(s, time.monotonic() + 30)


@pytest.mark.parametrize("name", ["x-request-id", "x-session-id"])
def test_a_non_utf8_id_header_is_an_openai_400(rel, name) -> None:
    """Serve's direct ingress decodes these as UTF-8 before the gateway runs: a byte that is not
    UTF-8 got uvicorn's plain-text 500, with nothing logged."""
    body = json.dumps({"model": MIX, "messages": OK_MSG, "max_tokens": 2}).encode()
    key = rel.keys.clients["chat"]
    head = f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
    status, headers, answer = _raw_request(
        rel, "/chat/completions", head + name.encode() + b": id-\xff\xfe\r\n", body
    )
    assert status == 400, answer[:300]
    err = json.loads(answer)
    assert is_openai_error(err) and err["error"]["param"] == name, err
    assert headers.get("x-request-id") and headers["content-type"] == "application/json"
    status, _, answer = _raw_request(rel, "/chat/completions", head + name.encode() + b": id-1\r\n", body)
    assert status == 200, answer[:300]  # the same request with a clean id is served


@pytest.mark.parametrize("path", ["/messages", "/responses"])
def test_the_native_routes_check_the_key_before_the_body(rel, path) -> None:
    """/v1/messages and /v1/responses parsed and translated a body before they checked the key
    (a 400 for this body without a key); the chat route checks first, and so do they now."""
    for headers in (
        {},
        {"x-api-key": "sk-wrong-0123456789"},
        {"authorization": "Bearer sk-wrong-0123456789"},
    ):
        r = httpx.post(
            rel.base_url + path,
            content=b"{not json",
            headers={**headers, "content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 401, (path, headers, r.status_code, r.text[:300])


@pytest.mark.parametrize("path", ["/messages", "/responses"])
def test_a_legal_non_ascii_body_is_not_grown_past_the_limit(rel, path) -> None:
    """The translation was written with escaped non-ASCII (a 3-byte character as 6 bytes), so a body
    within the limit could come back as a 413. The limit is on the client's bytes: this one (60 % of
    it, CJK text) is read, tokenized and refused for its length in tokens instead."""
    limit = rel.cluster.cfg.server.max_body_bytes
    text = "字" * int(0.6 * limit / 3)
    if path == "/messages":
        body = {"model": MIX, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    else:
        body = {"model": MIX, "max_output_tokens": 8, "input": text}
    data = json.dumps(body, ensure_ascii=False).encode()
    assert 0.5 * limit < len(data) < limit
    headers = {"x-api-key": rel.keys.clients["chat"], "content-type": "application/json"}
    r = httpx.post(rel.base_url + path, content=data, headers=headers, timeout=60)
    assert r.status_code == 400 and "context" in r.text.lower(), (r.status_code, r.text[:300])


# -- logs and metrics -----------------------------------------------------------------------------


def test_no_key_in_logs_or_metrics(rel) -> None:
    """After everything above (and the fault runs, when they ran first): neither the provider's key
    nor any client key in any file of this Ray session's log folder, nor in the exported metrics."""
    logs = log_dir()
    assert find_in_logs(logs, f"{rel.name}#Gateway"), "not the log folder of this Ray session"
    metrics = metrics_text()
    for secret in (rel.keys.provider, *rel.keys.clients.values()):
        assert find_in_logs(logs, secret) == [], secret[:12]
        assert secret not in metrics


def test_backend_env_values_stay_out_of_logs(rel) -> None:
    """A backend's `env` is set by the replica itself, not through Ray's runtime_env (whose agent logs
    env_vars in full, runtime_env_agent.log): a value there stays out of the logs too."""
    assert find_in_logs(log_dir(), rel.canary) == []
