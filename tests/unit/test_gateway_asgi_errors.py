"""What the gateway's ASGI entry answers when its route raises: an OpenAI error object, never the
HTTP server's plain-text 500 (uvicorn answers with one any exception that reaches it before a
response started)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.wire.errors import InvalidRequest
from deployments.gateway.gateway import Gateway

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def _run(exc: BaseException) -> tuple[list[dict[str, Any]], BaseException | None]:
    async def route(scope: Any, receive: Any, send: Any) -> None:
        raise exc

    # the entry point reads the gateway's routes only
    gw = SimpleNamespace(_routes={("POST", "/v1/chat/completions"): route})
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    raised = None
    try:
        asyncio.run(Gateway.func_or_class._asgi(gw, SCOPE, receive, send))
    except BaseException as e:  # what reaches the server
        raised = e
    return sent, raised


def _answer(sent: list[dict[str, Any]]) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    start, body = sent[0], sent[1]
    assert start["type"] == "http.response.start" and body["type"] == "http.response.body"
    return start["status"], dict(start["headers"]), json.loads(body["body"])


@pytest.mark.parametrize("exc", [SystemExit(1), KeyboardInterrupt(), GeneratorExit()])
def test_a_process_exit_before_the_answer_gets_the_openai_503_and_still_propagates(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="deployments.gateway.gateway"):
        sent, raised = _run(exc)
    assert any(type(exc).__name__ in r.getMessage() for r in caplog.records)  # an exit says what it was
    assert raised is exc  # the process still goes away
    status, headers, body = _answer(sent)
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert body["error"]["type"] == "overloaded_error" and body["error"]["code"] == "overloaded"


def test_a_cancellation_gets_the_same_503(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deployments.gateway.gateway"):
        sent, raised = _run(asyncio.CancelledError())
    assert not caplog.records  # a client gone is no news
    assert isinstance(raised, asyncio.CancelledError)
    status, _, body = _answer(sent)
    assert status == 503 and body["error"]["code"] == "overloaded"


def test_a_client_error_is_answered_and_not_raised() -> None:
    sent, raised = _run(InvalidRequest("bad field", param="messages"))
    assert raised is None
    status, _, body = _answer(sent)
    assert status == 400 and body["error"]["param"] == "messages"


def test_a_bug_is_a_500_error_object_not_plain_text() -> None:
    sent, raised = _run(ZeroDivisionError())
    assert raised is None
    status, headers, body = _answer(sent)
    assert status == 500 and headers[b"content-type"].startswith(b"application/json")
    assert "ZeroDivisionError" in body["error"]["message"]
