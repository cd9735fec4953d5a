"""Bad input gets an OpenAI-format 4xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration

OK_MSG = [{"role": "user", "content": "hi"}]


def _post(cluster, path: str, **kw) -> httpx.Response:
    return httpx.post(cluster.base_url + path, timeout=60, **kw)


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/chat/completions", {"model": "tiny-llama"}, 400, None),
        ("/chat/completions", {"model": "tiny-llama", "messages": []}, 400, None),
        ("/completions", {"model": "tiny-llama"}, 400, None),
        ("/completions", {"model": "tiny-llama", "prompt": ""}, 400, None),
        ("/chat/completions", {"model": "no-such-model", "messages": OK_MSG}, 404, "model_not_found"),
        ("/chat/completions", {"model": "tiny-llama", "messages": OK_MSG, "max_tokens": 0}, 400, None),
        ("/chat/completions", {"model": "tiny-llama", "messages": OK_MSG, "max_tokens": -5}, 400, None),
        (
            "/completions",
            {"model": "tiny-llama", "prompt": "x", "max_tokens": 5000},
            400,
            "context_length_exceeded",
        ),
        ("/chat/completions", {"model": "tiny-llama", "messages": "hello"}, 400, None),
        ("/chat/completions", {"model": "tiny-llama", "messages": OK_MSG, "temperature": "hot"}, 400, None),
        ("/chat/completions", {"model": "tiny-llama", "messages": OK_MSG, "stream": "yes"}, 400, None),
        (
            "/chat/completions",
            {"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            None,
        ),
        ("/chat/completions", {"model": 42, "messages": OK_MSG}, 400, None),
        ("/chat/completions", [1, 2, 3], 400, None),
    ],
)
def test_invalid_bodies(cluster, path, body, status, code) -> None:
    _assert_openai_error(_post(cluster, path, json=body), status, code)


def test_malformed_json(cluster) -> None:
    r = _post(
        cluster,
        "/chat/completions",
        content=b'{"model": "tiny-llama", "messages": [',
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(r, 400)


def test_invalid_utf8(cluster) -> None:
    r = _post(
        cluster,
        "/chat/completions",
        content=b'{"model": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(r, 400)


def test_context_error_gives_both_counts(cluster) -> None:
    err = _assert_openai_error(
        _post(cluster, "/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 5000}),
        400,
        "context_length_exceeded",
    )
    assert "2048" in err["message"] and "5000 in the completion" in err["message"]


def test_body_over_limit_gets_413(cluster) -> None:
    limit = cluster.cfg.server.max_body_bytes
    big = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a" * (limit + 10)}]}
    _assert_openai_error(_post(cluster, "/chat/completions", json=big), 413, "request_too_large")


def test_unknown_path_and_method(cluster) -> None:
    _assert_openai_error(httpx.get(cluster.base_url + "/nope", timeout=30), 404)
    _assert_openai_error(httpx.get(cluster.base_url + "/chat/completions", timeout=30), 405)


def test_unknown_surface_header(cluster) -> None:
    r = _post(
        cluster,
        "/chat/completions",
        json={"model": "tiny-llama", "messages": OK_MSG},
        headers={"x-surface": "nope"},
    )
    _assert_openai_error(r, 400)


def test_still_serving_after_bad_input(cluster) -> None:
    r = _post(cluster, "/chat/completions", json={"model": "tiny-llama", "messages": OK_MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_a_body_that_is_not_json_by_its_content_type_is_a_415(cluster) -> None:
    """Defect 8: a text/plain body was parsed as JSON and answered 200."""
    import json

    body = json.dumps({"model": "tiny-llama", "messages": OK_MSG, "max_tokens": 2})
    r = _post(cluster, "/chat/completions", content=body, headers={"content-type": "text/plain"})
    err = _assert_openai_error(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"]
    assert r.headers.get_list("x-request-id") and len(r.headers.get_list("x-request-id")) == 1
    for ctype in ("application/json; charset=utf-8", None):  # as the openai clients send it, or none
        headers = {"content-type": ctype} if ctype else {}
        ok = httpx.post(
            cluster.base_url + "/chat/completions",
            content=body.encode(),
            headers=headers,
            timeout=60,
        )
        assert ok.status_code == 200, (ctype, ok.text)


def test_two_streams_with_the_same_request_id_do_not_touch_each_other(cluster) -> None:
    """Defect 4: the client's x-request-id was the engine's request id; closing one stream with
    it ended another client's stream of the same id early, with a normal [DONE]."""
    import json
    import threading

    body = {
        "model": "tiny-llama",
        "messages": OK_MSG,
        "max_tokens": 300,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"x-request-id": "same-id-for-both"}
    counted: list[tuple[int, str | None]] = []

    def second() -> None:
        usage, finish = 0, None
        with httpx.stream(
            "POST", cluster.base_url + "/chat/completions", json=body, headers=headers, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for c in chunk["choices"]:
                        finish = c["finish_reason"] or finish
        counted.append((usage, finish))

    t = threading.Thread(target=second)
    t.start()
    with httpx.stream(
        "POST", cluster.base_url + "/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 20:
                break  # the first client leaves early
    t.join(120)
    # The second stream ran to its end: all 300 tokens, finished by length, not by someone's abort.
    assert counted == [(300, "length")], counted
