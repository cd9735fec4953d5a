"""Issue 47 item 6, the pure parts: the engine's token-id lines stay in the gateway, the headers Serve's
direct ingress would fail on or echo whole get an OpenAI 400 first, an internal path answers as an
unknown one, the native routes check the key before they read the body and keep non-ASCII text as
is, and a budgeted tenant without auth is a warning."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from cluster import cli
from cluster.config import parse_config
from cluster.config_checks import config_warnings
from cluster.wire.engine_stream import event_with_ids, parse_emitted, strip_ids
from cluster.wire.errors import Unauthorized
from deployments.gateway import header_guard, native_api
from deployments.gateway import http_api as h

# -- the engine's ": ids" lines ----------------------------------------------------------------


def test_the_token_ids_are_stripped_from_what_the_client_gets_and_kept_for_migration() -> None:
    events = (
        event_with_ids(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', [11, 12])
        + event_with_ids(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', [13])
        + b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    )
    out = strip_ids(events)
    assert b": ids" not in out and b"11" not in out
    assert out.count(b"data: ") == 3 and out.endswith(b"\n\n")
    assert [e for e in out.split(b"\n\n") if e] == [
        b'data: {"choices":[{"delta":{"content":"a"}}]}',
        b'data: {"choices":[{"delta":{"content":"b"}}]}',
        b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}',
    ]
    assert parse_emitted([events]).ids == [11, 12, 13]  # what migration reads: the bytes as received
    text = b'data: {"choices":[{"delta":{"content":"\\n: ids 1,2\\n"}}]}\n\n'  # generated text, escaped
    assert strip_ids(text) == text


# -- headers Serve's direct ingress reads ---------------------------------------------------------


@pytest.mark.parametrize("name", [b"x-request-id", b"x-session-id", b"traceparent"])
def test_a_non_utf8_header_that_serve_decodes_is_a_400_naming_it(name: bytes) -> None:
    err = header_guard.refusal([(b"host", b"x"), (name, b"ok\xff")])
    assert err is not None and err.status_code == 400 and err.param == name.decode()
    assert err.to_openai()["error"]["type"] == "invalid_request_error"


def test_a_long_request_id_is_refused_and_others_pass() -> None:
    limit = header_guard.MAX_REQUEST_ID
    err = header_guard.refusal([(b"x-request-id", b"a" * (limit + 1))])
    assert err is not None and err.param == "x-request-id" and str(limit) in err.message
    assert header_guard.refusal([(b"x-request-id", b"a" * limit)]) is None
    assert header_guard.refusal([(b"x-session-id", "café".encode())]) is None  # UTF-8 is fine
    assert header_guard.refusal([(b"user-agent", b"\xff" * 300)]) is None  # Serve never decodes it


def _asgi(app: Any, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def test_the_guard_answers_an_openai_400_with_one_id_of_ours_before_the_app() -> None:
    reached: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    guard = header_guard.middlewares()[0].cls(app)
    sent = _asgi(guard, [(b"x-request-id", b"\xc3\x28")])
    assert not reached
    start, body = sent
    assert start["status"] == 400
    ids = [v for k, v in start["headers"] if k == b"x-request-id"]
    assert len(ids) == 1 and ids[0] != b"\xc3\x28"
    assert json.loads(body["body"])["error"]["param"] == "x-request-id"
    assert _asgi(guard, [(b"x-request-id", b"fine-1")]) == [] and reached == [True]


def test_serves_own_timeout_and_disconnect_controls_never_reach_it_from_a_client() -> None:
    """A client could turn Serve's request timeout off, or keep its request generating (and billed)
    after it left: the guard drops those headers and leaves the rest as they were."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(list(scope["headers"]))

    guard = header_guard.middlewares()[0].cls(app)
    sent = [(b"x-request-disconnect-disabled", b"?1"), (b"x-a", b"1"), (b"x-request-timeout-seconds", b"0")]
    assert _asgi(guard, sent) == []
    assert seen == [[(b"x-a", b"1")]]
    assert header_guard.without_serve_controls([(b"x-a", b"1")]) is None  # nothing copied when absent


# -- an internal path is an unknown one -------------------------------------------------------------


def test_an_internal_path_answers_as_an_unknown_path_whatever_the_method() -> None:
    routes = [("POST", "/v1/chat/completions"), ("GET", "/internal/status")]
    unknown = h.no_route("GET", "/v1/nope", routes)
    hidden = h.no_route("GET", "/internal/status", ())
    for err in (hidden, h.no_route("POST", "/internal/status", routes)):
        assert (err.status_code, err.code, err.error_type) == (404, "not_found", "invalid_request_error")
        assert err.message.endswith(": Not Found") and unknown.message.endswith(": Not Found")
    assert h.no_route("GET", "/v1/chat/completions", routes).status_code == 405  # a public path


# -- /v1/messages and /v1/responses --------------------------------------------------------------


def _native(
    api: native_api.NativeApi, body: bytes, authorize: Any, limit: int = 1 << 20
) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], bytes]], int]:
    sent: list[dict[str, Any]] = []
    chat_got: list[tuple[dict[str, Any], bytes]] = []
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def chat(scope: Any, inner_receive: Any, inner_send: Any) -> None:
        chat_got.append((scope, (await inner_receive())["body"]))

    headers = [(b"x-api-key", b"sk-wrong"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": headers}
    asyncio.run(native_api.serve(api, chat, limit, authorize, scope, receive, send))
    return sent, chat_got, reads


@pytest.mark.parametrize("api", [native_api.MESSAGES, native_api.RESPONSES])
def test_the_native_routes_check_the_key_before_reading_the_body(api: native_api.NativeApi) -> None:
    seen: list[str | None] = []

    def refuse(scope: Any) -> None:
        seen.append(h.header(scope, b"authorization"))
        raise Unauthorized("Missing or invalid API key.")

    sent, chat_got, reads = _native(api, b"{not json", refuse)
    assert reads == 0 and not chat_got  # nothing of the refused caller's was read or parsed
    assert seen == ["Bearer sk-wrong"]  # x-api-key stands in for the bearer key
    assert sent[0]["status"] == 401
    body = json.loads(sent[1]["body"])
    assert "API key" in (body["error"]["message"])


def test_a_non_ascii_body_is_translated_as_is_and_measured_as_the_client_sent_it() -> None:
    text = "字" * 3000  # 9,000 bytes of UTF-8; 18,000 as \\u escapes
    raw = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}, ensure_ascii=False
    ).encode()
    sent, chat_got, _ = _native(native_api.MESSAGES, raw, lambda scope: None, limit=len(raw) + 100)
    assert not sent  # the chat route was reached: no 413
    (scope, translated) = chat_got[0]
    assert text.encode() in translated and len(translated) < len(raw) + 200
    assert h.header(scope, b"content-length") == str(len(translated))


# -- budgets without auth -------------------------------------------------------------------------


def _cfg(auth: bool, tenants: list[dict[str, Any]]) -> Any:
    key = {"sha256": "0" * 64, "surface": "chat"}
    return parse_config(
        {
            "models": [{"name": "m", "tokenizer": "estimate:4", "context_window": 100}],
            "backends": [{"name": "b", "kind": "sim", "model": "m"}],
            "surfaces": [{"name": "chat"}],
            "server": {"auth": auth, "api_keys": [key] if auth else []},
            "tenants": tenants,
        }
    )


def test_tenants_with_budgets_while_auth_is_off_are_a_warning_naming_them(tmp_path, capsys) -> None:
    tenants = [{"name": "acme", "tpm": 1000}, {"name": "free"}, {"name": "loop", "rpm": 5}]
    (warning,) = config_warnings(_cfg(False, tenants))
    assert "'acme'" in warning and "'loop'" in warning and "'free'" not in warning
    assert "auth" in warning and "x-tenant" in warning
    assert config_warnings(_cfg(True, tenants)) == []
    assert config_warnings(_cfg(False, [{"name": "free"}])) == []
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(_cfg(False, tenants).model_dump(mode="json")))
    assert cli.main(["check", "--config", str(path)]) == 0  # loads: a warning, not an error
    out = capsys.readouterr().out
    assert ": ok" in out and "warning:" in out and "'acme'" in out


def test_the_app_builder_logs_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    from deployments.app import build_graph

    with caplog.at_level(logging.WARNING, logger="deployments.app"):
        build_graph(_cfg(False, [{"name": "acme", "tpm": 1000}]))
    assert any("'acme'" in r.getMessage() and "auth" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deployments.app"):
        build_graph(_cfg(True, [{"name": "acme", "tpm": 1000}]))
    assert not caplog.records


def test_an_exit_before_any_answer_is_the_gateways_503_not_uvicorns_500() -> None:
    """CI saw uvicorn's plain-text 500 for a request whose gateway was killed while it waited:
    Serve's direct ingress raised outside the gateway's own handler. The guard, outermost, answers
    any such exit with the gateway's 503 and Retry-After (and re-raises); after a response started
    it adds nothing."""

    async def dies(scope: Any, receive: Any, send: Any) -> None:
        raise asyncio.CancelledError

    async def dies_late(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-stream")

    for app, status in ((dies, 503), (dies_late, 200)):
        sent: list[dict] = []

        async def send(message: dict, out: list[dict] = sent) -> None:
            out.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        guard = header_guard.middlewares()[0].cls(app)
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            asyncio.run(guard(scope, receive, send))
        starts = [m for m in sent if m["type"] == "http.response.start"]
        assert [m["status"] for m in starts] == [status]
        if status == 503:
            headers = dict(starts[0]["headers"])
            assert headers[b"retry-after"] == b"1" and b"x-request-id" in headers
            body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
            assert body["error"]["type"] == "overloaded_error"
