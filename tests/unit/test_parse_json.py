"""The request body's JSON: orjson's path and the general one give the same answer and the same 400s."""

from __future__ import annotations

import json

import pytest

from cluster.wire.errors import InvalidRequest
from deployments.gateway import http_api as h


def nested(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "def f(x): return {x: [1]}"}]}',
        '{"a": "héllo wörld 😀", "b": [1, 2.5, -0, true, null], "c": {"d": {}}}'.encode(),
        b'{"a": "\\ud83d\\ude00 pair", "b": "\\u00e9"}',
        b'{"k": 1, "k": 2}',  # the last one wins, as in json
        b'{"seed": 1234567890123456789012345}',  # past 64 bits: an int, not orjson's float
        b'{"x": 9223372036854775807, "y": -9223372036854775808}',
        b'{"t": NaN}',  # json's reading (the general path), as before
        nested(64),
    ],
)
def test_the_same_value_as_json(body: bytes) -> None:
    got = h.parse_json(body)
    want = json.loads(body.decode())
    assert got == want or (got != got and want != want)  # NaN equals nothing
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"a": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "lone UTF-16 surrogate"),  # a key too
        (nested(65), "nests deeper than 64"),
        (b'{"a": ' + b'{"b": ' * 70 + b"1" + b"}" * 71, "nests deeper than 64"),
        (nested(5000), "nests deeper"),
        (b'{"a": 1', "not valid JSON"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
    ],
)
def test_the_same_400s(body: bytes, says: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        h.parse_json(body)
    assert err.value.status_code == 400
    assert says in err.value.message
