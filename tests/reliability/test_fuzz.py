"""Fuzzed input against the gateway's own OpenAPI document (``/openapi.json``, request bodies and
headers declared there), with schemathesis: schema-valid and schema-violating requests for every
route. No 5xx, every 4xx its API's error object (Anthropic's on /v1/messages, OpenAI's elsewhere),
and the server still serves afterwards.

Then hand-written cases that extend tests/integration/test_bad_input.py: roles, ``stream`` types,
huge and odd numbers, deep nesting, invalid and unusual text encodings, header injection, unknown
paths and methods. ``LLMC_LONG=1`` fuzzes ten times as many examples.
"""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest

from loadtest.common.actor_probe import gateway_counters, wait_idle
from loadtest.common.reliability import CLAUDE, MIX, is_openai_error, our_id

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

EXAMPLES = 400 if os.environ.get("LLMC_LONG") == "1" else 40
ROUTES = {
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/models",
    "GET /healthz",
}
BODY_ROUTES = sorted(r for r in ROUTES if r.startswith("POST"))
OK_MSG = [{"role": "user", "content": "hi"}]


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...], code: str | None = None) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    assert is_openai_error(body), body
    assert r.headers.get("x-request-id")
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# ------------------------------------------------------------------------------------------------
# schemathesis over /openapi.json
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(rel):
    schemathesis = pytest.importorskip("schemathesis")
    return schemathesis.openapi.from_url(rel.url + "/openapi.json")


def test_openapi_document_declares_the_request_bodies(rel) -> None:
    doc = httpx.get(rel.url + "/openapi.json", timeout=30).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/responses", "ResponsesRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    schemas = doc["components"]["schemas"]
    refs = {v for v in _walk_refs(doc)}
    assert refs and all(r.split("/")[-1] in schemas for r in refs), refs  # every $ref resolves


def _walk_refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _walk_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_refs(v)


def is_anthropic_error(obj) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return (
        isinstance(obj, dict)
        and obj.get("type") == "error"
        and isinstance(err, dict)
        and isinstance(err.get("type"), str)
        and isinstance(err.get("message"), str)
        and bool(err["message"])
    )


# One plain body per body route, run first: the success side of each route is reached whatever
# the random bodies do (schema-valid bodies still fail the rules a JSON schema cannot say, or the
# upstream's own checks, and a shift in the generator's stream once left chat without a 200).
SERVED = {
    "/v1/chat/completions": {"messages": OK_MSG, "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": OK_MSG, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": OK_MSG},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}


def _served_example(op):
    from hypothesis import example

    body = SERVED.get(op.path)
    if body is None:
        return lambda f: f
    return example(case=op.Case(body={"model": MIX, **body}, media_type="application/json"), model=MIX)


def _cases(op, mode, unfillable: list[str]):
    """schemathesis' cases for ``op``, skipping a draw whose schema mutation it cannot fill itself.

    In negative mode schemathesis mutates the schema at random, and now and then builds an array
    of at least one item whose items nothing satisfies ("Cannot generate an array with 1 demanded
    elements"): an error of the generator, raised before any request, that failed the whole test
    (once in a fresh-clone run, on /v1/messages; the same draw in another order passes). Such a draw
    is rejected and counted; the test bounds how many there may be."""
    from hypothesis import reject
    from hypothesis import strategies as st
    from schemathesis.core.errors import InvalidSchema

    base = op.as_strategy(generation_mode=mode)

    @st.composite
    def cases(draw):
        try:
            return draw(base)
        except InvalidSchema as exc:
            unfillable.append(str(exc))
            reject()

    return cases()


def _fuzz(op, mode, examples: int, call, seen: dict[str, set[int]], problems: list[str]):
    """One operation in one generation mode: a Hypothesis test over schemathesis' cases."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    label = f"{op.method.upper()} {op.path}"
    unfillable: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(op, mode, unfillable), model=st.sampled_from([None, MIX, CLAUDE]))
    @_served_example(op)
    def run(case, model) -> None:
        # Most random model names are a 404: point a share of the bodies at real models.
        if model is not None and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        r = call(case)
        seen.setdefault(label, set()).add(r.status_code)
        if r.status_code >= 500:
            problems.append(f"{label}: {r.status_code} {r.text[:300]} for {case.body!r:.300}")
        elif r.status_code >= 400:
            # /v1/messages (and its count_tokens) answers in Anthropic's error shape, the rest in OpenAI's
            check = is_anthropic_error if op.path.startswith("/v1/messages") else is_openai_error
            try:
                ok = check(r.json())
            except ValueError:
                ok = False
            if not ok or not r.headers.get("x-request-id"):
                problems.append(f"{label}: {r.status_code} not its API's error object: {r.text[:300]}")

    def go() -> None:
        run()
        if len(unfillable) > examples // 4:  # the rejected draws sent nothing: most must be real
            problems.append(f"{label} {mode.name}: {len(unfillable)} draws unfillable: {unfillable[0]}")

    return go


def test_fuzz_every_route(rel, api_schema) -> None:
    from schemathesis import GenerationMode

    ops = [r.ok() for r in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} == ROUTES
    auth = rel.keys.headers("chat")
    seen: dict[str, set[int]] = {}
    problems: list[str] = []

    def call(case):
        return case.call(base_url=rel.url, headers=auth, timeout=60)

    for op in ops:
        if op.method.upper() == "POST":
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(op, mode, EXAMPLES, call, seen, problems)()
        else:
            _fuzz(op, GenerationMode.POSITIVE, 5, call, seen, problems)()
    assert problems == [], "\n".join(problems[:20])
    # The fuzzer reached both sides of validation on the body routes.
    for label in BODY_ROUTES:
        assert 200 in seen[label] and (seen[label] & {400, 404}), seen
    _still_serving(rel)


def _still_serving(rel) -> None:
    assert httpx.get(rel.url + "/healthz", timeout=30).status_code == 200
    body = {"model": MIX, "messages": OK_MSG, "max_tokens": 4}
    r = httpx.post(
        rel.base_url + "/chat/completions", json=body, headers=rel.keys.headers("chat"), timeout=60
    )
    assert r.status_code == 200, r.text
    counters = wait_idle(rel.name)
    assert counters and all(c["balanced"] and c["in_flight"] == 0 for c in counters.values()), counters


# ------------------------------------------------------------------------------------------------
# Hand-written cases
# ------------------------------------------------------------------------------------------------


def _post(rel, path: str, surface: str = "chat", headers: dict | None = None, **kw) -> httpx.Response:
    h = {**rel.keys.headers(surface), **(headers or {})}
    return httpx.post(rel.base_url + path, headers=h, timeout=60, **kw)


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}],
        [{"role": None, "content": "x"}],
        [{"role": 5, "content": "x"}],
        [{"role": "System", "content": "x"}],
        [{"role": "function", "content": "x"}],
        [{"role": "user\u0000", "content": "x"}],
        ["hi"],
        [None],
        [{"role": "user", "content": {"text": "a dict"}}],
        [{"role": "user", "content": [{"text": "a part without a type"}]}],
        [{"role": "user", "content": ["not a part"]}],
        [{"role": "user", "content": 42}],
    ],
)
def test_invalid_messages_are_400(rel, messages) -> None:
    assert_openai_error(_post(rel, "/chat/completions", json={"model": MIX, "messages": messages}), 400)


@pytest.mark.parametrize("value", [1, 0, "true", "false", None, [], {}, 1.0])
def test_stream_must_be_a_boolean(rel, value) -> None:
    err = assert_openai_error(
        _post(rel, "/chat/completions", json={"model": MIX, "messages": OK_MSG, "stream": value}), 400
    )
    assert err["param"] == "stream"


@pytest.mark.parametrize(
    "opts", [{"include_usage": "yes"}, {"include_usage": 1}, {"include_usage": None}, "x", [True]]
)
def test_stream_options_are_checked(rel, opts) -> None:
    body = {"model": MIX, "messages": OK_MSG, "stream": True, "stream_options": opts}
    assert_openai_error(_post(rel, "/chat/completions", json=body), 400)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        ('"max_tokens": 1e400', 400),  # inf
        ('"max_tokens": 10000000000000000000000000000000000000000', 400),  # beyond the window
        ('"max_tokens": 2.5', 400),
        ('"temperature": NaN', 400),
        ('"top_p": Infinity', 400),
        ('"presence_penalty": -Infinity', 400),
        ('"seed": 1180591620717411303424', (200, 400)),  # 2**70: refused or ignored, never a 5xx
        ('"seed": -1', (200, 400)),
        ('"n": 2', 200),  # the route's OpenAI-compatible provider honours it (issue 45)
        ('"n": 129', 400),  # OpenAI's limit
        ('"stop": [1, 2]', 400),
        ('"stop": ' + json.dumps(["s"] * 10_000), (200, 400)),
    ],
)
def test_odd_numbers_and_values(rel, raw, status) -> None:
    fields = raw if raw.startswith('"max_tokens"') else '"max_tokens": 3, ' + raw
    data = '{"model": "' + MIX + '", "messages": [{"role": "user", "content": "hi"}], ' + fields + "}"
    r = _post(rel, "/chat/completions", content=data.encode(), headers={"content-type": "application/json"})
    if r.status_code != 200:
        assert_openai_error(r, status)
    else:
        assert 200 in ((status,) if isinstance(status, int) else status), r.text
        _assert_answer(r)


@pytest.mark.parametrize("depth", [100, 5_000, 100_000])
def test_deeply_nested_bodies_are_400(rel, depth) -> None:
    data = ("[" * depth + "]" * depth).encode()
    assert_openai_error(_post(rel, "/chat/completions", content=data), 400)


@pytest.mark.parametrize("depth", [80, 400, 900])
def test_deep_nesting_in_an_extra_field_is_400(rel, depth) -> None:
    """Unknown fields are allowed (clients send many): nesting in them must not reach a recursion limit
    downstream (pydantic's dump, Ray's pickling) as a 500."""
    nested = "[" * depth + "]" * depth
    data = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": %s}'
    r = _post(rel, "/chat/completions", content=(data % (MIX, nested)).encode())
    assert_openai_error(r, 400)


def test_moderate_nesting_in_an_extra_field_is_served(rel) -> None:
    body = {"model": MIX, "messages": OK_MSG, "max_tokens": 2, "metadata": json.loads("[" * 30 + "]" * 30)}
    assert _post(rel, "/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    "data",
    [
        b'{"model": "rel-mix", "messages": [{"role": "user", "content": "\xc3\x28"}]}',  # bad continuation
        b'{"model": "rel-mix", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # surrogate
        b'{"model": "rel-mix", "messages": [{"role": "user", "content": "\xf8\x88\x80\x80\x80"}]}',
        b"\xef\xbb\xbf\xff",
        b"",
        b"null",
        b'"a string"',
        b"\x00\x00\x00\x00",
    ],
)
def test_invalid_encodings_and_non_objects_are_400(rel, data) -> None:
    assert_openai_error(_post(rel, "/chat/completions", content=data), 400)


def _assert_answer(r: httpx.Response) -> None:
    """A 200 that is a real chat completion: content, a finish reason, usage."""
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"], body
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"], body
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0, body


@pytest.mark.parametrize(
    ("content", "status"),
    [
        ("\ud800 lone surrogate", 400),  # a valid JSON escape, but no UTF-8 for a provider or tokenizer
        ("nul \u0000 inside", 200),
        ("\ufeff bom and \u202e bidi", 200),
        ("emoji \U0001f600 and combining e\u0301", 200),
    ],
)
@pytest.mark.parametrize("model", [MIX, CLAUDE])
def test_unusual_text_is_served_or_refused_cleanly(rel, content, status, model) -> None:
    """Text that JSON allows but UTF-8 or a tokenizer may not: each case has one right answer."""
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3})
    r = _post(rel, "/chat/completions", content=data.encode())  # json.dumps escapes: valid UTF-8 on the wire
    if status == 200:
        _assert_answer(r)
    else:
        assert_openai_error(r, status)


def test_utf16_body_is_refused(rel) -> None:
    """JSON on the wire is UTF-8 (RFC 8259 section 8.1); Python's json.loads would take UTF-16 bytes,
    we do not: a 400 that says so, never a 5xx or a guess."""
    data = json.dumps({"model": MIX, "messages": OK_MSG, "max_tokens": 2}).encode("utf-16")
    r = _post(rel, "/chat/completions", content=data)
    assert_openai_error(r, 400)


def test_chunked_body_over_the_limit_is_413(rel) -> None:
    limit = rel.cluster.cfg.server.max_body_bytes

    def chunks():
        head = b'{"model": "rel-mix", "messages": [{"role": "user", "content": "'
        yield head
        for _ in range(limit // 8192 + 2):
            yield b"a" * 8192
        yield b'"}]}'

    r = _post(rel, "/chat/completions", content=chunks())
    assert_openai_error(r, 413, "request_too_large")


def test_large_prompt_within_the_limit_is_a_clean_context_error(rel) -> None:
    words = "word " * 40_000  # 200 KB < 256 KiB limit, far over the 4k window
    r = _post(rel, "/chat/completions", json={"model": MIX, "messages": [{"role": "user", "content": words}]})
    assert_openai_error(r, 400, "context_length_exceeded")


def test_many_small_messages(rel) -> None:
    msgs = [{"role": "user", "content": "x"}] * 5_000
    r = _post(rel, "/chat/completions", json={"model": MIX, "messages": msgs, "max_tokens": 2})
    if r.status_code != 200:
        assert_openai_error(r, 400, "context_length_exceeded")


# -- headers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "session",
    ["a b", "x" * 129, "a/b", "a;b", "%0d%0aX-Injected: 1", "naïve", "a\tb"],
)
def test_unsafe_session_ids_are_400(rel, session) -> None:
    r = _post(
        rel,
        "/chat/completions",
        json={"model": MIX, "messages": OK_MSG, "max_tokens": 2},
        headers={"x-session-id": session.encode("utf-8")},
    )
    assert_openai_error(r, 400)


@pytest.mark.parametrize("user", ["a\r\nX-Injected: 1", "a\nb", "\u0000", "x" * 1000])
def test_unsafe_user_field_is_400(rel, user) -> None:
    body = {"model": MIX, "messages": OK_MSG, "max_tokens": 2, "user": user}
    assert_openai_error(_post(rel, "/chat/completions", json=body), 400)


def _raw(rel, request: bytes, timeout: float = 15.0) -> bytes:
    with socket.create_connection(("127.0.0.1", rel.cluster.port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


@pytest.mark.parametrize(
    "header",
    [
        b"x-session-id: abc\rX-Injected: 1",
        b"x-session-id: abc\r\n X-Injected: 1",  # obsolete line folding
        b"x-session-id: abc\x00def",
        b"x-session-id: abc\nX-Injected: 1",
    ],
)
def test_crlf_in_session_header_never_injects(rel, header) -> None:
    """CR, LF or NUL inside a header: refused (by the HTTP server or by us), never echoed as a header."""
    body = json.dumps({"model": MIX, "messages": OK_MSG, "max_tokens": 2}).encode()
    key = rel.keys.clients["chat"].encode()
    req = (
        b"POST " + rel.cluster.route_prefix.encode() + b"/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"authorization: Bearer " + key + b"\r\n" + header + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )
    resp = _raw(rel, req)
    head, _, _ = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    assert status in (200, 400), resp[:400]
    assert b"x-injected" not in head.lower()
    _still_serving(rel)


def test_our_request_id_is_always_a_safe_token(rel) -> None:
    """Our request id (the body's ``id``: ``chatcmpl-<ours>``) is always our own safe token, never
    the client's x-request-id (two clients may send the same one); the client's x-request-id is
    echoed exactly once, by Serve's middleware, on errors and answers alike (the gateway adds none of
    its own). Up to 256 bytes: a longer one is refused (test_security.py)."""
    seen: set[str] = set()
    for rid in ("a" * 256, "evil value;with=stuff", "ok-id.123"):
        r = _post(
            rel,
            "/chat/completions",
            json={"model": "nope", "messages": OK_MSG},
            headers={"x-request-id": rid},
        )
        assert_openai_error(r, 404)
        assert r.headers.get_list("x-request-id") == [rid], r.headers.get_list("x-request-id")[:3]
        r = _post(
            rel,
            "/chat/completions",
            json={"model": MIX, "messages": OK_MSG, "max_tokens": 2},
            headers={"x-request-id": rid},
        )
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-request-id") == [rid], r.headers.get_list("x-request-id")[:3]
        body = r.json()
        assert body["id"].startswith("chatcmpl-"), body["id"][:200]
        ours = our_id(body)
        assert 0 < len(ours) <= 128 and all(c.isalnum() or c in "._:-" for c in ours), ours[:200]
        assert ours != rid and rid not in ours, ours
        seen.add(ours)
    assert len(seen) == 3, seen  # a new id per request


# -- paths and methods ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/nope", 404),
        ("GET", "/v1", 404),
        ("GET", "/v1/chat", 404),
        ("GET", "/v1/" + "a" * 6000, 404),
        ("GET", "/v1/%ff%fe", 404),
        ("GET", "/v1/../v1/nope", 404),
        ("DELETE", "/v1/chat/completions", 405),
        ("PUT", "/v1/completions", 405),
        ("PATCH", "/v1/models", 405),
        ("POST", "/v1/models", 405),
        ("OPTIONS", "/v1/chat/completions", 405),
        ("TRACE", "/v1/models", 405),
    ],
)
def test_unknown_paths_and_methods_are_openai_errors(rel, method, path, status) -> None:
    r = httpx.request(method, rel.url + path, headers=rel.keys.headers("chat"), timeout=30)
    assert_openai_error(r, status)


def test_trailing_slash_is_not_a_5xx(rel) -> None:
    r = httpx.post(
        rel.base_url + "/chat/completions/",
        json={"model": MIX, "messages": OK_MSG, "max_tokens": 2},
        headers=rel.keys.headers("chat"),
        timeout=30,
    )
    assert r.status_code < 500
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)


def test_counters_balance_after_the_bad_input(rel) -> None:
    counters = wait_idle(rel.name)
    assert counters and all(c["balanced"] and c["in_flight"] == 0 for c in counters.values()), counters
    assert gateway_counters(rel.name)
