"""Fill-in-the-middle: the engine's prompt is the model's FIM tokens around the client's prefix
and suffix, in the configured order; the tiny model knows its FIM tokens as single tokens; the
capability table lets engines take ``suffix`` only on a model with a FIM template."""

from __future__ import annotations

import pytest

from cluster import tokens
from cluster.config import FimTemplate
from cluster.engine.tiny_model import FIM_TOKENS
from cluster.policy import capabilities as C
from cluster.wire.errors import InvalidRequest
from cluster.wire.fim import render
from cluster.wire.protocol import CompletionRequest
from cluster.wire.requests import prompt_ids

TINY = FimTemplate(**FIM_TOKENS)


def test_psm_and_spm_orders() -> None:
    t = FimTemplate(prefix="<P>", suffix="<S>", middle="<M>")
    assert render(t, "def f(x):\n    ", "\n    return y") == "<P>def f(x):\n    <S>\n    return y<M>"
    spm = t.model_copy(update={"order": "spm"})
    assert render(spm, "a", "b") == "<S>b<P>a<M>"


def test_the_engine_gets_prefix_suffix_and_middle_tokens_in_order() -> None:
    tok = tokens.load("@tiny")
    special = {k: tok.encode(v) for k, v in FIM_TOKENS.items()}
    assert all(len(ids) == 1 for ids in special.values())  # one token each, not spelled out
    req = CompletionRequest(model="m", prompt="def add(a, b):\n    ", suffix="\n    return c\n")
    ids, messages, text = prompt_ids(req, tok, TINY)
    p, s, m = special["prefix"][0], special["suffix"][0], special["middle"][0]
    assert ids[0] == p and ids[-1] == m
    cut = ids.index(s)
    assert ids[1:cut] == tok.encode(req.prompt)
    assert ids[cut + 1 : -1] == tok.encode(req.suffix or "")
    assert text == req.prompt and messages is None  # providers get the client's own prompt
    plain, _, _ = prompt_ids(req, tok)  # no template: the prompt alone
    assert plain == tok.encode(req.prompt)


def test_suffix_with_a_token_id_prompt_is_400() -> None:
    req = CompletionRequest(model="m", prompt=[1, 2, 3], suffix="x")
    with pytest.raises(InvalidRequest, match="suffix"):
        prompt_ids(req, tokens.load("@tiny"), TINY)


@pytest.mark.parametrize("kind", C.KINDS)
def test_suffix_needs_a_fim_template_on_engines(kind: str) -> None:
    kept, _ = C.narrow(["suffix"], ["b"], lambda _: kind, fim=True)
    assert kept == (["b"] if kind in ("vllm", "sim", "openai") else [])
    kept, _ = C.narrow(["suffix"], ["b"], lambda _: kind, fim=False)
    assert kept == (["b"] if kind == "openai" else [])
