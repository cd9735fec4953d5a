"""The tokenization path, and that the core imports without Ray or vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster import tokens
from cluster.config import parse_config
from cluster.policy.context import fit_context
from cluster.tokens.counters import CharEstimateTokenizer, HFFileTokenizer
from cluster.wire.errors import ContextLengthExceeded, NotFound
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest
from cluster.wire.requests import build_generate_request, lookup_model, prompt_ids


@pytest.fixture(scope="module")
def tok():
    return tokens.load("@tiny")


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
    cfg = _cfg()

    def check_context(n_prompt: int, max_tokens: int | None) -> int:
        fit = fit_context(cfg.models[0], lambda _: n_prompt, max_tokens, cfg.model, param="prompt")
        return fit.max_tokens

    assert check_context(60, None) == 30  # default
    assert check_context(90, None) == 10  # what room is left
    assert check_context(60, 40) == 40
    with pytest.raises(ContextLengthExceeded, match=r"100 tokens.*101 tokens \(60 in the prompt, 41"):
        check_context(60, 41)
    with pytest.raises(ContextLengthExceeded):
        check_context(100, None)


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
    est = CharEstimateTokenizer(4)
    assert len(est.encode("abcdefghi")) == 3
    assert not est.exact
    assert tokens.load("estimate:4").count("abcdefghi") == 3


def test_router_and_provider_adapter_count_an_hf_model_alike(tok, tmp_path) -> None:
    # A provider serving an open model whose tokenizer folder we hold: the adapter counts the chat
    # with the model's template, as the router does, so its budget reservation and the router's
    # context check agree (it used to count 4 tokens per message instead of the template).
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert tokens.load("@tiny", "openai") is tok
    tok._tok.save_pretrained(tmp_path)
    for api in ("openai", "anthropic"):
        counter = tokens.load(str(tmp_path), api)
        assert counter.exact and counter.count_chat(msgs) == len(tok.chat_ids(msgs))
    # A bare tokenizer.json (no template to apply) is still counted with framing estimated.
    (tmp_path / "tokenizer_config.json").unlink()
    bare = tokens.load(str(tmp_path / "tokenizer.json"), "openai")
    assert isinstance(bare, HFFileTokenizer) and not bare.exact


def test_core_imports_without_ray_or_vllm() -> None:
    code = (
        "import sys\n"
        "for name in ('ray', 'vllm', 'fastapi', 'torch'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import cluster, cluster.config, cluster.wire.protocol, cluster.wire.errors, cluster.wire.requests\n"
        "import cluster.tokens, cluster.wire.openai_format, cluster.wire.backend\n"
        "import pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(cluster.__path__, 'cluster.'):  # every module, at any depth\n"
        "    importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
