"""The capability table: every field some backend kind cannot honour is detected in a request,
refused on the kinds that lack it (a 400 naming the field and the backend), and narrows a route's
candidates to the backends that have it."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.config import parse_config
from cluster.policy import capabilities as C
from cluster.wire.errors import InvalidRequest
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest
from deployments.gateway import http_api as h
from deployments.gateway.prepare import model_gate, supporting_candidates

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# field -> (schema, the request body's fields that use it)
SAMPLES: dict[str, tuple[type, dict[str, Any]]] = {
    "temperature": (ChatCompletionRequest, {"temperature": 1.5}),
    "seed": (ChatCompletionRequest, {"seed": 7}),
    "presence_penalty": (ChatCompletionRequest, {"presence_penalty": 0.5}),
    "frequency_penalty": (ChatCompletionRequest, {"frequency_penalty": -0.5}),
    "ignore_eos": (ChatCompletionRequest, {"ignore_eos": True}),
    "logit_bias": (ChatCompletionRequest, {"logit_bias": {"42": -100}}),
    "logprobs": (ChatCompletionRequest, {"logprobs": True}),
    "top_logprobs": (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 2}),
    "n": (CompletionRequest, {"n": 3}),
    "prompt_logprobs": (CompletionRequest, {"prompt_logprobs": 0}),
    "tools": (ChatCompletionRequest, {"tools": [TOOL]}),
    "tool_choice": (ChatCompletionRequest, {"tools": [TOOL], "tool_choice": "required"}),
    "parallel_tool_calls": (ChatCompletionRequest, {"tools": [TOOL], "parallel_tool_calls": True}),
    "tools[].function.strict": (
        ChatCompletionRequest,
        {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
    ),
    "messages[].tool_calls": (
        ChatCompletionRequest,
        {"messages": [*MSG, {"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "x"}]},
    ),
    "messages[].role=tool": (
        ChatCompletionRequest,
        {"messages": [*MSG, {"role": "tool", "tool_call_id": "c1", "content": "4"}]},
    ),
    "response_format": (ChatCompletionRequest, {"response_format": {"type": "json_object"}}),
    "thinking": (ChatCompletionRequest, {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    "messages[].thinking_blocks": (
        ChatCompletionRequest,
        {
            "messages": [
                *MSG,
                {
                    "role": "assistant",
                    "content": "4",
                    "thinking_blocks": [{"type": "redacted_thinking", "data": "x"}],
                },
                {"role": "user", "content": "x"},
            ]
        },
    ),
    "messages[].name": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x", "name": "ann"}]},
    ),
    "messages[].content[].image_url": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ),
    "messages[].content[].cache_control": (
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
                }
            ]
        },
    ),
    "messages[].content[].input_audio": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
    ),
    "messages[].content[].file": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]},
    ),
    "messages[].audio": (
        ChatCompletionRequest,
        {"messages": [*MSG, {"role": "assistant", "audio": {"id": "a"}}, {"role": "user", "content": "x"}]},
    ),
    "messages[].function_call": (
        ChatCompletionRequest,
        {"messages": [*MSG, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
    ),
    "suffix": (CompletionRequest, {"suffix": "return x"}),
    "echo": (CompletionRequest, {"echo": True}),
    "best_of": (CompletionRequest, {"best_of": 3}),
    "audio": (ChatCompletionRequest, {"audio": {"voice": "alloy", "format": "wav"}}),
    "function_call": (ChatCompletionRequest, {"function_call": "auto"}),
    "functions": (ChatCompletionRequest, {"functions": [{"name": "f"}]}),
    "modalities": (ChatCompletionRequest, {"modalities": ["text", "audio"]}),
    "prediction": (ChatCompletionRequest, {"prediction": {"type": "content", "content": "x"}}),
    "prompt_cache_key": (ChatCompletionRequest, {"prompt_cache_key": "k"}),
    "prompt_cache_retention": (ChatCompletionRequest, {"prompt_cache_retention": "24h"}),
    "reasoning_effort": (ChatCompletionRequest, {"reasoning_effort": "low"}),
    "safety_identifier": (ChatCompletionRequest, {"safety_identifier": "u1"}),
    "service_tier": (ChatCompletionRequest, {"service_tier": "flex"}),
    "store": (ChatCompletionRequest, {"store": True}),
    "verbosity": (ChatCompletionRequest, {"verbosity": "low"}),
    "web_search_options": (ChatCompletionRequest, {"web_search_options": {}}),
}


def _api(schema: type, fields: dict[str, Any]) -> Any:
    base = (
        {"model": "m", "messages": MSG} if schema is ChatCompletionRequest else {"model": "m", "prompt": "p"}
    )
    return h.validate(schema, {**base, **fields})


def test_every_field_in_the_table_has_a_sample() -> None:
    assert set(SAMPLES) == set(C.SUPPORT)


@pytest.mark.parametrize("field", sorted(C.SUPPORT))
def test_a_used_field_is_detected_and_refused_where_unsupported(field: str) -> None:
    api = _api(*SAMPLES[field])
    assert field in C.used_fields(api)
    for kind in C.KINDS:
        kept, refusal = C.narrow(C.used_fields(api), ["b"], lambda _: kind)  # noqa: B023
        if kind in C.SUPPORT[field]:
            assert field not in (refusal.field if refusal else ""), kind
        else:
            assert kept == [] and refusal is not None
            assert field in [f for _, _, f in refusal.missing] or refusal.field in C.used_fields(api)
            assert f"(kind {kind})" in refusal.message()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "stop": ["x"], "stream": False, "user": "u"},
        {
            "logprobs": False,
            "n": 1,
            "store": False,
            "response_format": {"type": "text"},
            "metadata": {"a": "b"},
        },
        {"modalities": ["text"], "parallel_tool_calls": None, "tools": []},
        {"thinking": {"type": "disabled"}},
    ],
)
def test_neutral_values_ask_for_nothing(fields: dict[str, Any]) -> None:
    assert C.used_fields(_api(ChatCompletionRequest, fields)) == []


def test_narrow_keeps_the_order_of_the_supporting_candidates() -> None:
    kinds = {"v": "vllm", "o1": "openai", "a": "anthropic", "o2": "openai"}
    kept, refusal = C.narrow(["tools"], ["v", "o1", "a", "o2"], kinds.__getitem__)
    assert (kept, refusal) == (["o1", "a", "o2"], None)
    kept, refusal = C.narrow(["tools", "seed"], ["v", "o1", "a"], kinds.__getitem__)
    assert kept == ["o1"]


def test_the_refusal_says_what_each_candidate_lacks() -> None:
    kinds = {"v": "vllm", "a": "anthropic"}
    kept, refusal = C.narrow(["seed", "tools"], ["v", "a"], kinds.__getitem__)
    assert kept == [] and refusal is not None
    assert refusal.missing == [("v", "vllm", "tools"), ("a", "anthropic", "seed")]
    assert refusal.param == "tools"
    msg = refusal.message()
    assert "backend 'v' (kind vllm) cannot honour 'tools'" in msg
    assert "backend 'a' (kind anthropic) cannot honour 'seed'" in msg


def test_nested_fields_name_their_top_level_param() -> None:
    assert C.Refusal([("b", "vllm", "messages[].content[].image_url")]).param == "messages"
    assert C.Refusal([("b", "vllm", "tools[].function.strict")]).param == "tools"


def test_backend_kinds() -> None:
    assert C.backend_kind("provider", "anthropic") == "anthropic"
    assert C.backend_kind("provider", "openai") == "openai"
    assert C.backend_kind("vllm", None) == "vllm"
    with pytest.raises(ValueError):
        C.backend_kind("gpu", None)


def test_an_unknown_field_is_refused_in_openai_words() -> None:
    with pytest.raises(InvalidRequest) as exc:
        h.validate(ChatCompletionRequest, {"model": "m", "messages": MSG, "top_k": 5})
    assert str(exc.value) == "Unrecognized request argument supplied: top_k"
    assert exc.value.param == "top_k"
    with pytest.raises(
        InvalidRequest, match=r"Unrecognized request argument supplied: messages\.0\.cache_ctl"
    ):
        h.validate(ChatCompletionRequest, {"model": "m", "messages": [{**MSG[0], "cache_ctl": 1}]})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tool_choice": "auto"}, "only allowed when 'tools'"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not in 'tools'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "assistant"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ],
)
def test_malformed_tool_and_format_fields_are_400(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        _api(ChatCompletionRequest, fields)


def _cfg() -> Any:
    tiny = {"tokenizer": "estimate:4", "context_window": 4096}
    prov = {"base_url": "http://127.0.0.1:9/v1"}
    return parse_config(
        {
            "name": "caps",
            "models": [{"name": "m", **tiny}],
            "backends": [
                {"name": "sim-m", "kind": "sim", "model": "m"},
                {
                    "name": "claude-m",
                    "kind": "provider",
                    "model": "m",
                    "provider": {"api": "anthropic", **prov},
                },
                {"name": "gpt-m", "kind": "provider", "model": "m", "provider": {"api": "openai", **prov}},
            ],
            "surfaces": [{"name": "chat"}],
            "routes": [{"model": "m", "candidates": ["sim-m", "claude-m", "gpt-m"]}],
        }
    )


def test_the_route_is_narrowed_to_backends_that_honour_the_request() -> None:
    cfg = _cfg()
    route = cfg.candidates("m", "chat")
    assert supporting_candidates(cfg, _api(ChatCompletionRequest, {}), route) == route
    tools = _api(ChatCompletionRequest, {"tools": [TOOL]})
    assert supporting_candidates(cfg, tools, route) == ["claude-m", "gpt-m"]
    schema = _api(ChatCompletionRequest, {"tools": [TOOL], "response_format": {"type": "json_object"}})
    assert supporting_candidates(cfg, schema, route) == ["gpt-m"]
    with pytest.raises(InvalidRequest) as exc:
        supporting_candidates(cfg, _api(ChatCompletionRequest, {"seed": 1}), ["claude-m"])
    assert exc.value.status_code == 400 and exc.value.param == "seed"
    assert "backend 'claude-m' (kind anthropic) cannot honour 'seed'" in str(exc.value)


def test_a_text_only_model_refuses_images_on_every_backend() -> None:
    cfg = _cfg()
    route = cfg.candidates("m", "chat")
    image = [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}, {"type": "text", "text": "?"}]
    api = _api(ChatCompletionRequest, {"messages": [{"role": "user", "content": image}]})
    assert supporting_candidates(cfg, api, route) == ["claude-m", "gpt-m"]  # the model takes images
    text_only = cfg.models[0].model_copy(update={"accepts_images": False})
    with pytest.raises(InvalidRequest) as exc:
        supporting_candidates(cfg, api, route, gate=model_gate(text_only))
    assert exc.value.param == "messages" and exc.value.code == "unsupported_parameter"
    assert "Model 'm' is text-only (accepts_images: false)" in str(exc.value)
    assert "'messages[].content[].image_url'" in str(exc.value)
    plain = _api(ChatCompletionRequest, {})
    assert supporting_candidates(cfg, plain, route, gate=model_gate(text_only)) == route
