"""``logprobs`` on self-hosted engines (cluster/wire/logprobs.py): what a request asks, vLLM's
per-token logprobs as OpenAI's chat and completions shapes, their framing across a stream's events
and the whole answer, and the policy around them (capabilities, migration, tools)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.config import load_config
from cluster.policy import capabilities as C
from cluster.policy.migration import Break, MigrationPolicy
from cluster.wire import logprobs as L
from cluster.wire.engine_stream import end_frame, parse_control
from cluster.wire.errors import InvalidRequest
from cluster.wire.openai_format import ResponseMeta, full_response, stream_chunk
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, Sampling, Usage
from cluster.wire.requests import build_generate_request
from deployments.gateway import http_api as h

MSG = [{"role": "user", "content": "hi"}]


@dataclass
class Logprob:  # vLLM's vllm.logprobs.Logprob, field for field
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@pytest.mark.parametrize(
    ("kind", "logprobs", "top", "k"),
    [
        ("chat", None, None, None),
        ("chat", False, None, None),
        ("chat", True, None, 0),
        ("chat", True, 3, 3),
        ("completion", None, None, None),
        ("completion", 0, None, 0),
        ("completion", 5, None, 5),
    ],
)
def test_what_a_request_asks(kind: str, logprobs: Any, top: int | None, k: int | None) -> None:
    assert L.asked(kind, logprobs, top) == k


@pytest.mark.parametrize(
    ("kind", "logprobs", "top", "param"),
    [
        ("chat", 2, None, "logprobs"),
        ("chat", None, 2, "top_logprobs"),
        ("chat", False, 2, "top_logprobs"),
        ("completion", True, None, "logprobs"),
        ("completion", 21, None, "logprobs"),
        ("completion", -1, None, "logprobs"),
        ("completion", "2", None, "logprobs"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(kind: str, logprobs: Any, top: int | None, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        L.asked(kind, logprobs, top)
    assert err.value.param == param


def test_engine_logprobs_become_chat_entries_by_rank() -> None:
    steps = [
        {7: Logprob(-0.5, 2, "b"), 3: Logprob(-0.1, 1, "a"), 9: Logprob(-2.0, 3, "c")},
        {5: Logprob(-float("inf"), 40, "z"), 3: Logprob(-0.2, 1, "a"), 9: Logprob(-1.0, 2, "c")},
    ]
    out = L.from_engine([7, 5], steps, 2)
    assert [e["token"] for e in out] == ["b", "z"]
    assert out[0]["logprob"] == -0.5 and out[0]["bytes"] == [98]
    assert [(t["token"], t["logprob"]) for t in out[0]["top_logprobs"]] == [("a", -0.1), ("b", -0.5)]
    assert out[1]["logprob"] == L.FLOOR  # -inf is not JSON
    assert [t["token"] for t in out[1]["top_logprobs"]] == ["a", "c"]  # the sampled one is not in the top
    assert L.from_engine([7], steps[:1], 0)[0]["top_logprobs"] == []


def test_a_one_token_chunk_is_named_by_the_text_it_added() -> None:
    """A character split over two tokens: the first adds nothing, the second the whole character."""
    part = L.from_engine([1], [{1: Logprob(-1.0, 1, "\ufffd")}], 1, "")
    whole = L.from_engine([2], [{2: Logprob(-1.0, 1, "\ufffd")}], 1, "é")
    assert (part[0]["token"], part[0]["bytes"]) == ("", [])
    assert (whole[0]["token"], whole[0]["bytes"]) == ("é", [0xC3, 0xA9])
    several = L.from_engine([1, 2], [{1: Logprob(-1.0, 1, "x")}, {2: Logprob(-1.0, 1, "y")}], 0, "xy")
    assert [e["token"] for e in several] == ["x", "y"]


def test_the_completions_shape_has_offsets_into_the_text() -> None:
    entries = [L.entry("def", -0.1, [("def", -0.1), ("class", -2.0)]), L.entry(" f", -0.3)]
    got = L.shape("completion", entries, 10)
    assert got == {
        "tokens": ["def", " f"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"def": -0.1, "class": -2.0}, {}],
        "text_offset": [10, 13],
    }
    assert L.shape("chat", entries) == {"content": entries, "refusal": None}


def test_framing_carries_entries_to_the_next_event_and_keeps_them_for_the_whole() -> None:
    f = L.LogprobsFraming("completion", collect=True)
    assert f.take() is None
    f.add([L.entry("", -1.0)])  # a chunk that sent no event: its entry waits
    f.add([L.entry("é", -0.5)])
    first = f.take()
    assert first is not None and first["tokens"] == ["", "é"] and first["text_offset"] == [0, 0]
    f.add([L.entry("x", -0.2)])
    second = f.take()
    assert second is not None and second["text_offset"] == [1]
    whole = f.whole()
    assert whole is not None and whole["tokens"] == ["", "é", "x"]
    assert L.LogprobsFraming("chat", collect=False).whole() is None


def test_the_shapes_ride_on_events_the_end_frame_and_the_whole_answer() -> None:
    meta = ResponseMeta(kind="chat", request_id="r", model="m", created=1)
    lp = L.shape("chat", [L.entry("a", -0.1)])
    assert stream_chunk(meta, "a", None, logprobs=lp)["choices"][0]["logprobs"] == lp
    assert stream_chunk(meta, "a", None)["choices"][0]["logprobs"] is None
    assert full_response(meta, "a", "stop", Usage(1, 1), logprobs=lp)["choices"][0]["logprobs"] == lp
    end = parse_control(end_frame("stop", Usage(1, 1), "a", "r1", None, lp).rstrip(b"\n"))
    assert end.logprobs == lp and end.text == "a"
    assert parse_control(end_frame("stop", Usage(1, 1)).rstrip(b"\n")).logprobs is None
    assert not math.isinf(L.entry("x", -math.inf)["logprob"])


def test_vllm_honours_logprobs_and_the_sim_and_anthropic_still_refuse_them() -> None:
    for fields in ({"logprobs": True, "top_logprobs": 2}, {"logprobs": True}):
        used = C.used_fields(h.validate(ChatCompletionRequest, {"model": "m", "messages": MSG, **fields}))
        for kind, ok in (("vllm", True), ("openai", True), ("sim", False), ("anthropic", False)):
            kept, refusal = C.narrow(used, ["b"], lambda _: kind)  # noqa: B023
            assert (kept == ["b"]) == ok, kind
            if not ok:
                assert refusal is not None and "cannot honour 'logprobs'" in refusal.message()
    zero = h.validate(CompletionRequest, {"model": "m", "prompt": "p", "logprobs": 0})
    assert "logprobs" in C.used_fields(zero)  # a completion's 0 asks for the sampled tokens' own


def test_a_stream_with_logprobs_is_not_migrated() -> None:
    req = GenerateRequest("r1", "m", "completion", [1, 2], Sampling(max_tokens=10, logprobs=2))
    brk = Break(reason="death", backend_kind="vllm", migrations=0, tokens_known=True, time_left_s=None)
    assert MigrationPolicy().decide(req, brk, 0.0).why == "logprobs"


def _build(schema: type, body: dict[str, Any]) -> GenerateRequest:
    cfg = load_config(Path(__file__).parents[2] / "configs" / "local.yaml")
    api = h.validate(schema, {"model": "tiny-llama", **body})
    model = cfg.model("tiny-llama")
    assert model is not None
    kw: dict[str, Any] = {"request_id": "r", "surface": "chat", "session_id": None, "timeout_s": 10.0}
    return build_generate_request(api, model, [1], None, None, max_tokens=4, **kw)


def test_the_engine_request_carries_the_top_count() -> None:
    chat = _build(ChatCompletionRequest, {"messages": MSG, "logprobs": True, "top_logprobs": 2})
    assert chat.sampling.logprobs == 2
    assert _build(CompletionRequest, {"prompt": "p", "logprobs": 3}).sampling.logprobs == 3
    assert _build(ChatCompletionRequest, {"messages": MSG}).sampling.logprobs is None


def test_logprobs_with_a_tool_call_parser_is_a_400() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(InvalidRequest) as err:
        _build(ChatCompletionRequest, {"messages": MSG, "logprobs": True, "tools": tools})
    assert err.value.param == "logprobs"
    none = {"messages": MSG, "logprobs": True, "tools": tools, "tool_choice": "none"}
    assert _build(ChatCompletionRequest, none).sampling.logprobs == 0  # no parser: served


def test_a_providers_logprobs_are_read_off_its_stream() -> None:
    from cluster.providers import openai_wire

    item = {"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": []}
    choice = {"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": [item]}}
    chat = json.dumps({"choices": [choice]}).encode()
    got = openai_wire.plain_text(chat)
    assert not isinstance(got, str)  # not the text-only fast path: the logprobs would be lost
    assert openai_wire.parse_stream_obj(got).logprobs == [item]
    legacy = {"tokens": ["a", "b"], "token_logprobs": [-0.1, None], "top_logprobs": [{"a": -0.1}, None]}
    entries = L.from_openai(legacy)
    assert entries is not None and [e["token"] for e in entries] == ["a", "b"]
    assert entries[1]["logprob"] == L.FLOOR and entries[0]["top_logprobs"][0]["token"] == "a"
    assert L.from_openai(None) is None and L.from_openai({"tokens": 1}) is None


def test_a_chunk_of_several_tokens_names_them_so_that_they_join_to_its_text() -> None:
    """CI saw a random-weight answer start with a replacement character that no token's own
    decoding had: the names still join to the text."""
    assert L.names(["", "field"], "\ufffdfield") == ["", "\ufffdfield"]
    assert L.names(["a", "b", "c"], "abc") == ["a", "b", "c"]
    assert L.names(["a", "x", "c"], "abc") == ["a", "", "bc"]
    assert L.names(["tok"], "other") == ["other"]
    assert L.names(["a", "b"], None) == ["a", "b"]


def test_prompt_logprobs_in_vllms_server_shape_where_its_server_puts_them() -> None:
    prompt = L.prompt_shape([None, {4: Logprob(-1.5, 2, "a"), 8: Logprob(-float("inf"), 1, "b")}])
    assert prompt == [
        None,
        {
            "4": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
            "8": {"logprob": L.FLOOR, "rank": 1, "decoded_token": "b"},
        },
    ]
    json.dumps(prompt, allow_nan=False)  # -inf clamped: valid JSON
    frame = parse_control(end_frame("stop", Usage(2, 1), "x", prompt_logprobs=prompt).rstrip(b"\n"))
    assert frame.prompt_logprobs == prompt
    chat = L.with_prompt(full_response(ResponseMeta("chat", "r", "m"), "x", "stop", Usage(2, 1)), prompt)
    assert chat["prompt_logprobs"] == prompt and "prompt_logprobs" not in chat["choices"][0]
    text = L.with_prompt(
        full_response(ResponseMeta("completion", "r", "m"), "x", "stop", Usage(2, 1)), prompt
    )
    assert text["choices"][0]["prompt_logprobs"] == prompt and "prompt_logprobs" not in text


def test_prompt_logprobs_is_vllms_only_and_never_streamed() -> None:
    asked = CompletionRequest(model="m", prompt="p", prompt_logprobs=0)  # 0: the prompt tokens' own
    assert C.used_fields(asked) == ["prompt_logprobs"]
    assert C.unsupported(["prompt_logprobs"], "vllm") == []
    assert all(C.unsupported(["prompt_logprobs"], k) for k in ("sim", "openai", "anthropic"))
    model = load_config("configs/local.yaml").models[0]
    kw = {"request_id": "r", "surface": "chat", "session_id": None, "timeout_s": 5.0, "max_tokens": 4}
    built = build_generate_request(asked, model, [1, 2], None, "p", **kw)
    assert built.sampling.prompt_logprobs == 0
    streamed = CompletionRequest(model="m", prompt="p", prompt_logprobs=2, stream=True)
    with pytest.raises(InvalidRequest) as err:
        build_generate_request(streamed, model, [1, 2], None, "p", **kw)
    assert err.value.param == "prompt_logprobs" and "stream=True" in err.value.message
