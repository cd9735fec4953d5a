"""The tokenization path, and that the core imports without Ray or vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.config import parse_config
from cluster.errors import ContextLengthExceeded, NotFound
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from cluster.requests import build_generate_request, check_context, lookup_model, prompt_ids
from cluster.tokens import EstimateTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("@tiny")


def test_chat_ids_apply_the_chat_template(tok) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    text = tok.render_chat(msgs)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nbe brief<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.chat_ids(msgs)
    assert ids[0] == tok._tok.bos_token_id
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text


def test_prompt_ids_for_chat_and_completion(tok) -> None:
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    )
    ids, messages, text = prompt_ids(chat, tok)
    assert ids == tok.chat_ids([{"role": "user", "content": "hi"}])
    assert messages and text is None
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "import os"})
    ids, messages, text = prompt_ids(comp, tok)
    assert ids == tok.encode("import os") and messages is None and text == "import os"
    comp_ids = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]})
    assert prompt_ids(comp_ids, tok)[0] == [5, 6, 7]


def _cfg():
    return parse_config(
        {
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 100, "default_max_tokens": 30}],
            "backends": [{"name": "b", "kind": "sim", "model": "m"}],
            "surfaces": [{"name": "chat"}],
        }
    )


def test_context_check_never_truncates() -> None:
    model = _cfg().models[0]
    assert check_context(model, 60, None) == 30  # default
    assert check_context(model, 90, None) == 10  # what room is left
    assert check_context(model, 60, 40) == 40
    with pytest.raises(ContextLengthExceeded, match=r"100 tokens.*101 tokens \(60 in the prompt, 41"):
        check_context(model, 60, 41)
    with pytest.raises(ContextLengthExceeded):
        check_context(model, 100, None)


def test_unknown_model_is_404() -> None:
    with pytest.raises(NotFound) as info:
        lookup_model(_cfg(), "gpt-9")
    assert info.value.status_code == 404 and info.value.to_openai()["error"]["param"] == "model"


def test_generate_request_carries_sampling(tok) -> None:
    api = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0,
            "stop": "END",
            "seed": 7,
        }
    )
    ids, msgs, text = prompt_ids(api, tok)
    g = build_generate_request(
        api,
        _cfg().models[0],
        ids,
        msgs,
        text,
        request_id="r1",
        surface="chat",
        session_id="s",
        timeout_s=5,
        max_tokens=9,
    )
    assert g.kind == "chat" and g.sampling.max_tokens == 9 and g.sampling.temperature == 0
    assert g.sampling.stop == ["END"] and g.sampling.seed == 7 and g.session_id == "s"


def test_estimate_tokenizer() -> None:
    est = EstimateTokenizer(4)
    assert len(est.encode("abcdefghi")) == 3
    assert not est.exact


def test_core_imports_without_ray_or_vllm() -> None:
    code = (
        "import sys\n"
        "for name in ('ray', 'vllm', 'fastapi', 'torch'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import cluster, cluster.config, cluster.protocol, cluster.errors, cluster.requests, cluster.tokens\n"
        "import cluster.openai_format, cluster.backend\n"
        "import pkgutil, importlib\n"
        "for m in pkgutil.iter_modules(cluster.__path__):\n"
        "    importlib.import_module('cluster.' + m.name)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
