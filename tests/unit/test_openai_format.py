"""The SSE writer's fast paths give the same bytes, and the same JSON, as the general one."""

from __future__ import annotations

import json

import pytest

from cluster.wire.openai_format import ResponseMeta, TextEvents, dumps, loads, sse, stream_chunk

TEXTS = ["hello", "", " ", 'quote " and \\ backslash', "é 漢字 🙂", "line\nbreak\ttab", "\x00\x1f"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_event_is_the_general_chunk_byte_for_byte(kind: str, text: str) -> None:
    meta = ResponseMeta(kind, "rid-1", 'model/with"quote', created=1700000000)  # type: ignore[arg-type]
    general = sse(stream_chunk(meta, text, None, first=False))
    assert TextEvents(meta).event(text) == general
    assert json.loads(general[len(b"data: ") :]) == stream_chunk(meta, text, None, first=False)


def test_what_orjson_refuses_is_still_written_and_read_as_before() -> None:
    lone = "\ud800"  # a lone surrogate: valid in a JSON string escape, refused by orjson
    out = dumps({"t": lone, "big": 2**70})
    assert json.loads(out) == {"t": lone, "big": 2**70}
    assert loads('{"t": "\\ud800"}') == {"t": lone}
    with pytest.raises(ValueError):
        loads("not json")


def test_sse_frames_a_string_as_is() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
