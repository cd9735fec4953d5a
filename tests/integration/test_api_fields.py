"""Issue 18 on a local Ray Serve: every request field is honoured on the backend that serves it or
refused with a 400 naming the field and the backend; a route narrows to the backends that honour
what a request uses; tools round-trip through our OpenAI endpoint to the Anthropic loopback server
(translated) and to the OpenAI-compatible one (passed through), streaming and not, with the
official ``openai`` client, and the upstream request is checked field by field."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from cluster import tokens
from cluster.config import parse_config
from cluster.policy import capabilities as C
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest
from cluster.wire.requests import prompt_ids
from fixtures.servers.anthropic_server import AnthropicServer
from fixtures.servers.openai_server import OpenAIServer
from loadtest.common.reliability import provider_backend
from tests.unit.test_capabilities import SAMPLES, _api

pytestmark = pytest.mark.integration

KEY = "sk-test-fields-0123456789"
KEY_ENV = "LLMC_TEST_PROVIDER_KEY"
DATA = Path(__file__).parents[1] / "unit" / "data" / "tools"
WEATHER = json.loads((DATA / "openai_round_trip.json").read_text())["tools"]
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
MODEL_OF_KIND = {"sim": "fx-sim", "anthropic": "fx-claude", "openai": "fx-gpt", "vllm": "tiny-llama"}
BACKEND_OF_KIND = {"sim": "fx-sim-b", "anthropic": "fx-claude-b", "openai": "fx-gpt-b", "vllm": "vllm-tiny"}
WINDOW = 4096  # every fx model's context window
CAP = 5  # the 'capped' surface's max_output_tokens


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[OpenAIServer, AnthropicServer]]:
    with (
        OpenAIServer(api_key=KEY, output_tokens=6) as oai,
        AnthropicServer(api_key=KEY, output_tokens=6) as ant,
    ):
        yield oai, ant


_provider = functools.partial(
    provider_backend, key_env=KEY_ENV, env={KEY_ENV: KEY}, first_token_timeout_s=10
)  # (name, api, url, model)


@pytest.fixture(scope="module")
def fx(deploy, servers):
    oai, ant = servers
    tiny = {"tokenizer": "@tiny", "context_window": WINDOW, "default_max_tokens": 16}
    sim = {"kind": "sim", "resources": {"num_cpus": 0.1}, "sim_profile": "llama-3.1-8b-h100"}
    cfg = parse_config(
        {
            "name": "llm-cluster-fields",
            "models": [
                *({"name": n, **tiny} for n in ("fx-sim", "fx-claude", "fx-mix")),
                # no default_max_tokens: a request without max_tokens gets the rest of the window
                {"name": "fx-gpt", "tokenizer": "@tiny", "context_window": WINDOW},
                {"name": "fx-text", "accepts_images": False, **tiny},  # a text-only model
            ],
            "backends": [
                {"name": "fx-sim-b", "model": "fx-sim", **sim},
                {"name": "fx-mix-sim", "model": "fx-mix", **sim},
                _provider("fx-claude-b", "anthropic", ant.base_url, "fx-claude"),
                _provider("fx-gpt-b", "openai", oai.base_url, "fx-gpt"),
                _provider("fx-mix-claude", "anthropic", ant.base_url, "fx-mix"),
                _provider("fx-mix-gpt", "openai", oai.base_url, "fx-mix"),
                _provider("fx-text-gpt", "openai", oai.base_url, "fx-text"),
            ],
            "surfaces": [
                {"name": "chat", "priority": 1},
                {"name": "capped", "priority": 1, "max_output_tokens": CAP},
            ],
            "routes": [{"model": "fx-mix", "candidates": ["fx-mix-sim", "fx-mix-claude", "fx-mix-gpt"]}],
        }
    )
    return deploy(cfg, route_prefix="/fields")


# configs/local.yaml's tiny-llama has a FIM template and a tool-call format: vLLM takes suffix
# (tested below) and tools (tests/integration/test_vllm_tools.py) there.
_CASES = [
    (kind, f)
    for kind in C.KINDS
    for f in sorted(C.SUPPORT)
    if kind not in C.SUPPORT[f] and not (kind == "vllm" and (f in C.WITH_FIM or f in C.WITH_TOOLS))
]


@pytest.mark.parametrize(("kind", "field"), _CASES, ids=[f"{k}-{f}" for k, f in _CASES])
def test_an_unsupported_field_is_a_400_naming_it_and_the_backend(request, fx, kind: str, field: str) -> None:
    schema, fields = SAMPLES[field]
    base = request.getfixturevalue("cluster").base_url if kind == "vllm" else fx.base_url
    model = MODEL_OF_KIND[kind]
    if schema is CompletionRequest:
        path, body = "/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 4, **fields}
    else:
        path, body = "/chat/completions", {"model": model, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(base + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_parameter" and err["type"] == "invalid_request_error"
    # The first field (in the table's order) this kind lacks: the sample may use others with it.
    engine = kind == "vllm"  # tiny-llama's FIM template and tool-call format count there
    first = C.unsupported(C.used_fields(_api(schema, fields)), kind, fim=engine, tools=engine)[0]
    assert field in C.used_fields(_api(schema, fields))
    said = "'temperature' above 1" if first == "temperature" else f"'{first}'"
    assert f"backend '{BACKEND_OF_KIND[kind]}' (kind {kind}) cannot honour {said}" in err["message"]
    assert err["param"] == C.Refusal([("", "", first)]).param


def _chat(fx, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": ASK, "max_tokens": 8, **extra}
    return httpx.post(fx.base_url + "/chat/completions", json=body, timeout=30)


def test_a_route_narrows_to_the_backends_that_honour_the_request(fx) -> None:
    assert _chat(fx, "fx-mix").headers["x-llmc-backend"] == "fx-mix-sim"
    assert _chat(fx, "fx-mix", tools=WEATHER).headers["x-llmc-backend"] == "fx-mix-claude"
    r = _chat(fx, "fx-mix", tools=WEATHER, response_format={"type": "json_object"})
    assert r.headers["x-llmc-backend"] == "fx-mix-gpt"
    r = _chat(fx, "fx-mix", seed=1, response_format={"type": "json_object"}, ignore_eos=True)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "'fx-mix-sim' (kind sim) cannot honour 'response_format'" in msg
    assert "'fx-mix-gpt' (kind openai) cannot honour 'ignore_eos'" in msg


def test_an_unknown_field_is_refused_not_ignored(fx) -> None:
    r = _chat(fx, "fx-gpt", top_k=3)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: top_k"


def _round_trip(client: OpenAI, model: str, stream: bool) -> tuple[Any, list[dict[str, Any]]]:
    """Call -> tool result -> answer, as an agent does it; returns (the answer, the calls)."""
    kw: dict[str, Any] = {"model": model, "tools": WEATHER, "max_tokens": 64}
    if stream:
        parts = list(client.chat.completions.create(messages=ASK, stream=True, **kw))
        assert parts[-1].choices[0].finish_reason == "tool_calls"
        pieces = [tc for p in parts for tc in (p.choices[0].delta.tool_calls or [])]
        assert len(pieces) > 2  # streamed in pieces, not one delta
        calls: dict[int, dict[str, Any]] = {}
        for tc in pieces:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] = (tc.function.name if tc.function else None) or c["name"]
            c["arguments"] += (tc.function.arguments if tc.function else None) or ""
        got = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]
    else:
        first = client.chat.completions.create(messages=ASK, **kw)
        assert first.choices[0].finish_reason == "tool_calls"
        got = [tc.model_dump() for tc in first.choices[0].message.tool_calls or []]
    assert [c["function"]["name"] for c in got] == ["get_weather"]
    assert json.loads(got[0]["function"]["arguments"]) == {"location": "San Francisco, CA"}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "15 degrees"} for c in got]
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": got}, *results]
    answer = client.chat.completions.create(messages=follow, **kw)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content
    return answer, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_tool_round_trip_through_anthropic(fx, servers, stream: bool) -> None:
    _, ant = servers
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    ant.reset()
    _, calls = _round_trip(client, "fx-claude", stream)
    first, second = (rec.body for rec in ant.stats().records[-2:])
    # Field by field what the Messages API gets (the documented tool shape, tool_use/tool_result).
    expected_tools = json.loads((DATA / "anthropic_round_trip.json").read_text())["tools"]
    assert first["tools"] == expected_tools and "tool_choice" not in first
    assert first["messages"] == [{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}]
    use = {
        "type": "tool_use",
        "id": calls[0]["id"],
        "name": "get_weather",
        "input": {"location": "San Francisco, CA"},
    }
    result = {"type": "tool_result", "tool_use_id": calls[0]["id"], "content": "15 degrees"}
    assert second["messages"][1:] == [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    assert calls[0]["id"].startswith("toolu_")  # Anthropic's own id, kept through the round trip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_tool_round_trip_through_an_openai_compatible_provider(fx, servers, stream: bool) -> None:
    oai, _ = servers
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    oai.reset()
    _round_trip(client, "fx-gpt", stream)
    first, second = (rec.body for rec in oai.stats().records[-2:])
    assert first["tools"] == WEATHER  # passed through as sent
    call_id = second["messages"][1]["tool_calls"][0]["id"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": call_id, "content": "15 degrees"}


def test_named_tool_choice_and_no_parallel_calls_reach_anthropic(fx, servers) -> None:
    _, ant = servers
    two = [*WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = _chat(fx, "fx-claude", tools=two, tool_choice=choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["get_time"]
    body = ant.stats().records[-1].body
    assert body["tool_choice"] == {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    r = _chat(fx, "fx-claude", tools=two, tool_choice="required")
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]  # parallel calls
    assert ant.stats().records[-1].body["tool_choice"] == {"type": "any"}


def test_json_schema_on_vllm_cpu_returns_json_that_validates(cluster) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    client = OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120)
    for stream in (False, True):
        kw = {"model": "tiny-llama", "messages": ASK, "max_tokens": 200, "response_format": fmt}
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(stream=True, **kw)
                if c.choices
            )
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)  # the random-weight model, held to the schema


def test_fim_on_vllm_cpu_sends_the_models_fim_prompt(cluster) -> None:
    from cluster import tokens
    from cluster.wire.fim import render

    model = cluster.cfg.model("tiny-llama")
    assert model is not None and model.fim is not None
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    r = httpx.post(
        cluster.base_url + "/completions",
        json={"model": "tiny-llama", "prompt": prefix, "suffix": suffix, "max_tokens": 4},
        headers={"x-surface": "tab"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-llmc-backend"] == "vllm-tiny"
    ids = tokens.load("@tiny").encode(render(model.fim, prefix, suffix))
    # The engine counted the FIM prompt (prefix, suffix and middle tokens around the two texts),
    # not the prefix alone.
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert len(ids) > len(tokens.load("@tiny").encode(prefix)) + 3


# -- /v1/messages: Anthropic-native clients ------------------------------------------------------
ANT_TOOLS = json.loads((DATA / "anthropic_round_trip.json").read_text())["tools"]


def _anthropic_round_trip(fx, model: str, stream: bool) -> list[Any]:
    """The official anthropic client through our /v1/messages: call -> tool_result -> answer."""
    import anthropic

    client = anthropic.Anthropic(base_url=fx.url, api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": model, "max_tokens": 64, "tools": ANT_TOOLS}
    ask = [{"role": "user", "content": ASK[0]["content"]}]
    if stream:
        with client.messages.stream(messages=ask, **kw) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(messages=ask, **kw)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"location": "San Francisco, CA"})]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "15 degrees"} for u in uses]
    follow = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
              {"role": "user", "content": results}]  # fmt: skip
    answer = client.messages.create(messages=follow, **kw)
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text" and answer.content[0].text
    assert answer.usage.output_tokens > 0
    return uses


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_tool_round_trip_to_an_openai_compatible_provider(fx, servers, stream: bool) -> None:
    oai, _ = servers
    oai.reset()
    uses = _anthropic_round_trip(fx, "fx-gpt", stream)
    first, second = (rec.body for rec in oai.stats().records[-2:])
    assert first["tools"] == WEATHER  # the Anthropic tool, as OpenAI's function tool
    args = json.dumps({"location": "San Francisco, CA"})
    call = {"id": uses[0].id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    assert second["messages"][1] == {"role": "assistant", "tool_calls": [call]}
    assert second["messages"][2] == {"role": "tool", "tool_call_id": uses[0].id, "content": "15 degrees"}


def test_messages_on_a_simulated_engine_and_errors_in_anthropic_shape(fx) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=fx.url, api_key="x", max_retries=0)
    with client.messages.stream(
        model="fx-sim", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model="fx-sim",
            max_tokens=5,
            extra_body={"top_k": 3},
            messages=[{"role": "user", "content": "hi"}],
        )
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "top_k" in exc.value.message
    with pytest.raises(anthropic.BadRequestError, match="tools"):  # the sim cannot call tools: said so
        client.messages.create(
            model="fx-sim", max_tokens=5, tools=ANT_TOOLS, messages=[{"role": "user", "content": "x"}]
        )


# -- /v1/responses: the openai client's Responses API ---------------------------------------------
RESP_TOOLS = [{"type": "function", **WEATHER[0]["function"]}]


def test_responses_function_call_round_trip(fx, servers) -> None:
    oai, _ = servers
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    first = client.responses.create(
        model="fx-gpt", input=ASK[0]["content"], tools=RESP_TOOLS, max_output_tokens=64
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"location": "San Francisco, CA"})
    ]
    assert oai.stats().records[-1].body["tools"] == WEATHER  # the flat Responses tool, as chat's
    follow = [
        {"role": "user", "content": ASK[0]["content"]},
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": "get_weather",
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "15 degrees"},
    ]
    events = list(client.responses.create(model="fx-gpt", input=follow, tools=RESP_TOOLS, stream=True))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    final = events[-1].response
    assert final.output_text and final.usage is not None and final.usage.output_tokens > 0
    sent = oai.stats().records[-1].body["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "15 degrees"}


def test_responses_on_a_simulated_engine_and_a_refused_field(fx) -> None:
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    r = client.responses.create(model="fx-sim", input="hi", max_output_tokens=4)
    assert r.status == "incomplete" and r.output_text and r.usage and r.usage.output_tokens == 4
    with pytest.raises(BadRequestError, match="previous_response_id"):
        client.responses.create(model="fx-sim", input="hi", previous_response_id="resp_1")


def test_messages_share_the_chat_routes_narrowing_and_failover(fx, servers) -> None:
    _, ant = servers
    body = {"model": "fx-mix", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(fx.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-llmc-backend"] == "fx-mix-sim"
    r = httpx.post(fx.url + "/v1/messages", json={**body, "tools": ANT_TOOLS}, timeout=30)
    assert r.headers["x-llmc-backend"] == "fx-mix-claude"  # the sim cannot call tools
    ant.push_faults("500")  # the Anthropic backend fails before its first token: on to the next
    r = httpx.post(fx.url + "/v1/messages", json={**body, "tools": ANT_TOOLS}, timeout=30)
    assert r.status_code == 200 and r.headers["x-llmc-backend"] == "fx-mix-gpt"
    assert r.json()["stop_reason"] == "tool_use" and r.json()["content"][0]["type"] == "tool_use"


# -- prompt caching: cached-token usage as each backend counted it ---------------------------------
# About 1,100 of the loopback servers' tokens (their minimum to cache is 1,024) and 2,000 of the tiny
# model's (its window is 4,096).
RULES = " ".join(f"Rule {i}: keep the code tidy and the tests honest." for i in range(90))
BREAKPOINT = {"type": "ephemeral"}


def _usage_of(client: OpenAI, stream: bool, **kw: Any) -> Any:
    if not stream:
        return client.chat.completions.create(**kw).usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == []
    return chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_cache_writes_and_reads_reach_openai_usage(fx, servers, stream: bool) -> None:
    _, ant = servers
    ant.reset()
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    system = [{"type": "text", "text": RULES, "cache_control": BREAKPOINT}]
    kw = {"model": "fx-claude", "max_tokens": 8, "messages": [{"role": "system", "content": system}, *ASK]}
    first, second = _usage_of(client, stream, **kw), _usage_of(client, stream, **kw)
    wrote, read = ant.stats().records
    assert wrote.body["system"] == system  # the breakpoint reached Anthropic on its block
    assert wrote.cache_write_tokens > 1000 and wrote.cached_tokens == 0
    assert first.prompt_tokens_details.cached_tokens == 0
    assert first.model_extra["cache_creation_input_tokens"] == wrote.cache_write_tokens
    assert read.cached_tokens == wrote.cache_write_tokens and read.cache_write_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == read.cached_tokens
    assert "cache_creation_input_tokens" not in (second.model_extra or {})
    assert first.prompt_tokens == second.prompt_tokens == read.prompt_tokens  # input + read + written


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_openai_compatible_providers_cached_tokens_pass_through(fx, servers, stream: bool) -> None:
    oai, _ = servers
    oai.reset()
    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    kw = {"model": "fx-gpt", "max_tokens": 8, "messages": [{"role": "user", "content": RULES + " Ready?"}]}
    first, second = _usage_of(client, stream, **kw), _usage_of(client, stream, **kw)
    cold, warm = oai.stats().records
    assert first.prompt_tokens_details.cached_tokens == cold.cached_tokens == 0
    assert warm.cached_tokens >= 1024 and warm.cached_tokens % 128 == 0
    assert second.prompt_tokens_details.cached_tokens == warm.cached_tokens
    assert "cache_creation_input_tokens" not in (second.model_extra or {})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_report_cache_reads_and_writes_as_anthropic_usage(fx, servers, stream: bool) -> None:
    import anthropic

    oai, ant = servers
    oai.reset()
    ant.reset()
    client = anthropic.Anthropic(base_url=fx.url, api_key="x", max_retries=0)

    def usage(model: str, system: Any) -> Any:
        kw: dict[str, Any] = {"model": model, "max_tokens": 8, "system": system, "messages": ASK}
        if not stream:
            return client.messages.create(**kw).usage
        with client.messages.stream(**kw) as s:
            return s.get_final_message().usage

    blocks = [{"type": "text", "text": RULES, "cache_control": BREAKPOINT}]
    first, second = usage("fx-claude", blocks), usage("fx-claude", blocks)
    wrote, read = ant.stats().records
    assert (first.cache_creation_input_tokens, first.cache_read_input_tokens) == (wrote.cache_write_tokens, 0)
    assert (second.cache_creation_input_tokens, second.cache_read_input_tokens) == (0, read.cached_tokens)
    assert first.cache_creation_input_tokens > 1000 and second.input_tokens == first.input_tokens
    assert second.input_tokens == read.prompt_tokens - read.cached_tokens  # Anthropic's own split
    usage("fx-gpt", RULES)  # automatic caching upstream
    warm = usage("fx-gpt", RULES)
    assert warm.cache_read_input_tokens == oai.stats().records[-1].cached_tokens >= 1024
    usage("fx-sim", RULES)  # the simulated engine's prefix cache
    assert usage("fx-sim", RULES).cache_read_input_tokens > 1000
    with pytest.raises(anthropic.BadRequestError, match="cache_control"):  # OpenAI has no breakpoints
        usage("fx-gpt", blocks)


# -- extended thinking: passed through with signatures to Anthropic, refused elsewhere -------------
THINKING = {"type": "enabled", "budget_tokens": 1024}


def _thinking_round_trip(fx, servers, stream: bool, ask: str) -> list[dict[str, Any]]:
    """The anthropic client through /v1/messages with thinking on: call -> tool_result -> answer,
    the thinking block sent back as it came (the loopback server checks its signature)."""
    import anthropic

    _, ant = servers
    ant.reset()
    client = anthropic.Anthropic(base_url=fx.url, api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "fx-claude", "max_tokens": 2048, "tools": ANT_TOOLS, "thinking": THINKING}
    messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
    if stream:
        with client.messages.stream(messages=messages, **kw) as s:
            kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
            first = s.get_final_message()
        assert "thinking_delta" in kinds or first.content[0].type == "redacted_thinking"
    else:
        first = client.messages.create(messages=messages, **kw)
    assert first.stop_reason == "tool_use" and first.content[0].type in ("thinking", "redacted_thinking")
    turn = [b.model_dump(exclude_none=True) for b in first.content]
    uses = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "15 degrees"} for u in uses]
    messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": results}]
    answer = client.messages.create(messages=messages, **kw)  # a changed signature would be a 400
    assert answer.stop_reason == "end_turn" and answer.content[-1].type == "text"
    calls, follow = ant.stats().records
    assert calls.body["thinking"] == follow.body["thinking"] == THINKING
    assert follow.body["messages"][1]["content"][0] == turn[0]  # the block as Anthropic gave it
    return turn


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinking_blocks_round_trip_with_their_signatures(fx, servers, stream: bool) -> None:
    from fixtures.servers import thinking as TH

    turn = _thinking_round_trip(fx, servers, stream, ASK[0]["content"])
    assert turn[0] == {"type": "thinking", "thinking": TH.THOUGHT, "signature": TH.sign(TH.THOUGHT)}
    redacted = _thinking_round_trip(fx, servers, stream, TH.MAGIC)
    assert redacted[0]["type"] == "redacted_thinking" and redacted[0]["data"]


def test_thinking_is_refused_where_it_cannot_be_honoured_and_narrows_the_route(fx) -> None:
    body = {"model": "fx-gpt", "max_tokens": 2048, "thinking": THINKING, "messages": ASK}
    for model in ("fx-gpt", "fx-sim"):
        r = httpx.post(fx.url + "/v1/messages", json={**body, "model": model}, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "cannot honour 'thinking'" in r.json()["error"]["message"]
    r = httpx.post(fx.url + "/v1/messages", json={**body, "model": "fx-mix"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-llmc-backend"] == "fx-mix-claude"
    assert r.json()["content"][0]["type"] == "thinking"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinking_through_our_openai_endpoint(fx, servers, stream: bool) -> None:
    from fixtures.servers import thinking as TH

    client = OpenAI(base_url=fx.base_url, api_key="x", max_retries=0)
    kw: dict[str, Any] = {
        "model": "fx-claude",
        "max_tokens": 2048,
        "messages": ASK,
        "extra_body": {"thinking": THINKING},
    }
    if stream:
        pieces = [
            c.choices[0].delta.model_extra.get("thinking_blocks")
            for c in client.chat.completions.create(stream=True, **kw)
            if c.choices
        ]
        items = [i for p in pieces if p for i in p]
        assert "".join(i.get("thinking", "") for i in items) == TH.THOUGHT
        assert [i["signature"] for i in items if "signature" in i] == [TH.sign(TH.THOUGHT)]
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.model_extra["thinking_blocks"] == [
            {"type": "thinking", "thinking": TH.THOUGHT, "signature": TH.sign(TH.THOUGHT)}
        ]
        assert msg.content


# -- a text-only model: image parts are a 400 naming the field, whatever the backend --------------
PNG = (  # one pixel
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
    "AAAABJRU5ErkJggg=="
)


def test_images_to_a_text_only_model_are_refused_before_any_backend(fx, servers) -> None:
    oai, _ = servers
    oai.reset()
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PNG}}]
    r = _chat(fx, "fx-text", messages=[{"role": "user", "content": parts}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["code"] == "unsupported_parameter"
    assert "'fx-text' is text-only" in err["message"] and "image_url" in err["message"]
    source = {"type": "base64", "media_type": "image/png", "data": PNG.split(",", 1)[1]}
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]
    body = {"model": "fx-text", "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}
    r = httpx.post(fx.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "text-only" in r.json()["error"]["message"]
    assert oai.stats().requests == 0  # nothing went upstream
    assert _chat(fx, "fx-text").status_code == 200  # text is served
    parts_gpt = _chat(fx, "fx-gpt", messages=[{"role": "user", "content": parts}])
    assert parts_gpt.status_code == 200  # a model that takes images passes them on


def test_images_count_against_the_context_window_as_the_provider_counts_them(fx, servers) -> None:
    oai, _ = servers
    oai.reset()
    image = {"type": "image_url", "image_url": {"url": "https://example.com/photo.jpg"}}
    parts = [{"type": "text", "text": "What is this?"}, image]
    # 3,000 + a short prompt fits the 4,096 window; an image OpenAI may count at 1,445 does not
    r = _chat(fx, "fx-gpt", messages=[{"role": "user", "content": parts}], max_tokens=3000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert oai.stats().requests == 0
    low = {"type": "image_url", "image_url": {"url": "https://example.com/photo.jpg", "detail": "low"}}
    r = _chat(fx, "fx-gpt", messages=[{"role": "user", "content": [parts[0], low]}], max_tokens=3000)
    assert r.status_code == 200, r.text  # detail low: 85 tokens
    assert oai.stats().records[-1].body["messages"][0]["content"][1] == low


def test_the_output_length_is_the_windows_rest_and_a_cap_says_so(fx, servers) -> None:
    oai, _ = servers
    capped = "x-llmc-max-tokens-capped"

    def chat(model: str, surface: str = "chat", **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": ASK, **extra}
        r = httpx.post(
            fx.base_url + "/chat/completions", json=body, headers={"x-surface": surface}, timeout=30
        )
        assert r.status_code == 200, r.text
        return r

    # No max_tokens, no configured limit: the rest of the window goes upstream, and no header.
    prompt = len(
        prompt_ids(
            ChatCompletionRequest.model_validate({"model": "m", "messages": ASK}), tokens.load("@tiny")
        )[0]
    )
    assert capped not in chat("fx-gpt").headers
    assert oai.stats().records[-1].body["max_tokens"] == WINDOW - prompt
    assert capped not in chat("fx-gpt", max_tokens=8).headers  # the client's own
    # The model's default_max_tokens shortened an unasked answer (on the sim: 16 tokens, cut).
    r = chat("fx-sim")
    assert r.headers[capped] == "16" and r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # The surface's cap lowers a larger ask and an unasked answer, on engines and providers alike.
    r = chat("fx-sim", "capped", max_tokens=8)
    assert r.headers[capped] == str(CAP) and r.json()["usage"]["completion_tokens"] == CAP
    assert chat("fx-gpt", "capped").headers[capped] == str(CAP)
    assert oai.stats().records[-1].body["max_tokens"] == CAP
    assert capped not in chat("fx-sim", "capped", max_tokens=CAP).headers  # not above the cap
    # A stream says so in its headers too, and the Messages API passes them on.
    body = {"model": "fx-sim", "messages": ASK, "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", fx.base_url + "/chat/completions", json=body, headers={"x-surface": "capped"}
    ) as r:
        assert r.status_code == 200 and r.headers[capped] == str(CAP)
        r.read()
    body = {"model": "fx-sim", "max_tokens": 8, "messages": ASK}
    r = httpx.post(fx.url + "/v1/messages", json=body, headers={"x-surface": "capped"}, timeout=30)
    assert (
        r.status_code == 200 and r.headers[capped] == str(CAP) and r.json()["usage"]["output_tokens"] == CAP
    )
