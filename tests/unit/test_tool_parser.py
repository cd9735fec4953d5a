"""The tool-call parsers (cluster.wire.tool_parser): whole texts, and the same texts cut anywhere."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.wire.tool_parser import (
    CallListParser,
    HermesParser,
    Item,
    NamedParser,
    Parser,
    call_id,
    collect,
    make_parser,
)


def _ids(i: int) -> str:
    return call_id("req-1", i)


def _run(parser: Parser, pieces: list[str]) -> tuple[list[Item], tuple[str, list[dict]]]:
    items: list[Item] = []
    for p in pieces:
        items += parser.feed(p)
    items += parser.finish()
    return items, collect(items)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "n": {"a": 1}}}\n</tool_call>'
HERMES_TEXTS = [
    "plain text, no call at all < > { }",
    "Let me check." + CALL + " and " + CALL.replace("get_weather", "f2"),
    CALL + "tail <tool_ca",  # a partial opening tag at the end is content
    '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>',  # another key order
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"name": "cut", "arguments": {"x": "a<b}"',  # the stream ended inside the call
    '<tool_call>{"name":"f","arguments":{}}</tool_call><tool_call>{"name":"g","arguments":{"k":[1,2]}}</tool_call>',
]


def test_hermes_calls_and_content() -> None:
    _, (text, calls) = _run(HermesParser(_ids), [HERMES_TEXTS[1]])
    assert text == "Let me check. and "
    assert [c["function"]["name"] for c in calls] == ["get_weather", "f2"]
    assert [c["id"] for c in calls] == [_ids(0), _ids(1)]
    for c in calls:
        assert json.loads(c["function"]["arguments"]) == {"location": "Paris", "n": {"a": 1}}


def test_hermes_odd_blocks() -> None:
    _, (text, calls) = _run(HermesParser(_ids), [HERMES_TEXTS[3]])
    assert text == "" and calls[0]["function"] == {"name": "late_name", "arguments": '{"x":1}'}
    _, (text, calls) = _run(HermesParser(_ids), [HERMES_TEXTS[4]])
    assert text == HERMES_TEXTS[4] and calls == []  # not a call: the content as written
    _, (text, calls) = _run(HermesParser(_ids), [HERMES_TEXTS[5]])
    assert calls[0]["function"] == {"name": "cut", "arguments": '{"x": "a<b}"'}
    _, (text, calls) = _run(HermesParser(_ids), [CALL + "tail <tool_ca"])
    assert text == "tail <tool_ca" and len(calls) == 1


def test_hermes_at_most_one_call_when_parallel_calls_are_off() -> None:
    _, (text, calls) = _run(HermesParser(_ids, max_calls=1), [HERMES_TEXTS[6]])
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert text == '<tool_call>{"name":"g","arguments":{"k":[1,2]}}</tool_call>'


def test_hermes_streams_arguments_before_the_call_closes() -> None:
    p = HermesParser(_ids)
    first = p.feed('<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert first == [
        {
            "index": 0,
            "id": _ids(0),
            "type": "function",
            "function": {"name": "f", "arguments": '{"city": "Par'},
        }
    ]
    assert p.feed('is"}') == [{"index": 0, "function": {"arguments": 'is"'}}]  # "}" may close the object
    assert p.feed("}\n</tool_call>") == [{"index": 0, "function": {"arguments": "}"}}]


def test_named_and_list_parsers() -> None:
    _, (text, calls) = _run(NamedParser(_ids, "f"), ['{"a":', "1}"])
    assert text == "" and calls == [
        {"id": _ids(0), "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    out = '[{"name":"f","arguments":{"s":"}{[\\""}},{"name":"g","arguments":{}}]'
    _, (text, calls) = _run(CallListParser(_ids), [out])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"s": '}{["'}),
        ("g", {}),
    ]
    assert make_parser({"mode": "list"}, "r").feed("[") == []


def _cuts(text: str, points: list[int]) -> list[str]:
    cuts = sorted({p % (len(text) + 1) for p in points})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


_FRAGMENTS = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f", "arguments": ',
     '{"name":"g","arguments":', "{", "}", " ", "\n", '"x"', ":", ",", "1", "<", "text", '"a}b"', "\\",
     '[{"name":"f","arguments":{"q":2}}'],
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.sampled_from(HERMES_TEXTS), st.lists(_FRAGMENTS, max_size=30).map("".join)),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    st.sampled_from(["hermes", "hermes1", "named", "list"]),
)
def test_incremental_parsing_equals_whole_text_parsing(text: str, points: list[int], mode: str) -> None:
    spec = {"hermes": {"mode": "hermes"}, "hermes1": {"mode": "hermes", "max_calls": 1},
            "named": {"mode": "named", "name": "f"}, "list": {"mode": "list"}}[mode]  # fmt: skip
    whole = _run(make_parser(spec, "rq"), [text])[1]
    pieces = _run(make_parser(spec, "rq"), _cuts(text, points))[1]
    assert pieces == whole
    if mode.startswith("hermes") and "<tool_call>" not in text:
        assert whole == (text, [])  # no call: every character is content
