"""Build the tiny local model: a random-weight Llama with a byte-level BPE tokenizer trained offline.

Nothing comes from a model hub. The tokenizer is trained on local text (this Python's standard
library sources), has special tokens (FIM's prefix, suffix and middle among them) and a ChatML chat
template that renders tools, calls and tool results (Hermes-style); the model is a 2-layer Llama
(hidden 128, 4 heads, 2 KV heads, vocab 2048, 2048 positions) in bf16 with seeded random weights.
Its output is gibberish; it exercises the real engine, scheduler, KV cache and prefix caching.

    python -m cluster.engine.tiny_model            # builds once into the cache folder, prints the path
    python -m cluster.engine.tiny_model --shape gpu-1b   # the same tokenizer, a Llama big enough for a GPU

Idempotent: a finished build leaves a marker file and is reused. ``gpu-1b`` (0.73 B parameters,
1.5 GB in bf16, 8k positions) is what ``scripts/gpu-check.sh`` loads on a GPU; it is built the
same way, on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

VERSION = "v3"  # v2: FIM tokens; v3: a tool-aware chat template (a new folder each: builds in use stay)
VOCAB = 2048
CONTEXT = 2048
FIM_TOKENS = {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>", "middle": "<|fim_middle|>"}
SPECIAL = [
    "<|pad|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    *FIM_TOKENS.values(),
]
# ChatML, tool-aware in the Hermes way (``tool_calls: {format: hermes}`` in the config names it):
# with ``tools`` a system turn lists them in <tools></tools> and shows the <tool_call> format; an
# assistant turn's calls are <tool_call> blocks with the arguments as the client sent them; a
# ``tool`` turn's result sits in <tool_response></tool_response>. Without tools or tool turns
# it renders exactly v2's ChatML (the same token ids for every other prompt).
_CONTENT = (
    "{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions. "
    "Their signatures are within <tools></tools>:\n<tools>\n"
    "{% for t in tools %}{{ (t['function'] if t['function'] is defined else t) | tojson }}\n{% endfor %}"
    "</tools>\n\nFor each call, write a JSON object with the function's name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n" + _CONTENT + "{{ '\\n' }}</tool_response>"
    "{% else %}" + _CONTENT + "{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n"
    "{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The geometry the config's `kv:` section for this model must match.
GEOMETRY = {"layers": 2, "kv_heads": 2, "head_dim": 32, "dtype_bytes": 2}
# Llama shapes by name: hidden, intermediate, layers, heads, KV heads, head dim, positions.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32,
             "positions": CONTEXT},
    # Llama-3.2-1B's layer geometry with our small vocabulary: ~0.73 B parameters.
    "gpu-1b": {"hidden": 2048, "intermediate": 5632, "layers": 16, "heads": 32, "kv_heads": 8,
               "head_dim": 64, "positions": 8192},
}  # fmt: skip


def kv_geometry(shape: str) -> dict[str, int]:
    """The `kv:` section of a config serving this shape (bf16)."""
    g = SHAPES[shape]
    return {"layers": g["layers"], "kv_heads": g["kv_heads"], "head_dim": g["head_dim"], "dtype_bytes": 2}


def param_count(shape: str) -> int:
    g = SHAPES[shape]
    h, kv = g["hidden"], g["kv_heads"] * g["head_dim"]
    attn = h * g["heads"] * g["head_dim"] * 2 + h * kv * 2
    layer = attn + 3 * h * g["intermediate"] + 2 * h
    return g["layers"] * layer + 2 * VOCAB * h + h


def cache_root() -> Path:
    return Path(os.environ.get("LLMC_CACHE", Path.home() / ".cache" / "llm-cluster"))


def tiny_model_path(shape: str = "tiny") -> Path:
    return cache_root() / f"{shape}-llama-{VERSION}"


def _corpus(limit_bytes: int = 3_000_000) -> list[str]:
    """Deterministic local training text: the standard library's own sources, sorted."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for f in sorted(lib.glob("*.py")):
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def llama_config(shape: str = "tiny", **extra: Any) -> Any:  # Any: transformers' LlamaConfig and its kwargs
    """The ``LlamaConfig`` of one of :data:`SHAPES` (``extra``: token ids, dtype)."""
    from transformers import LlamaConfig

    g = SHAPES[shape]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=g["hidden"],
        intermediate_size=g["intermediate"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        max_position_embeddings=g["positions"],
        tie_word_embeddings=False,
        **extra,
    )


def _build_model(out: Path, eos_id: int, bos_id: int, pad_id: int, shape: str = "tiny") -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = llama_config(
        shape, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, torch_dtype="bfloat16"
    )
    device = "cuda" if shape != "tiny" and torch.cuda.is_available() else "cpu"  # random init is faster there
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def build(force: bool = False, shape: str = "tiny") -> Path:
    out = tiny_model_path(shape)
    marker = out / ".complete"
    if marker.exists() and not force:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(tmp)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp))
    _build_model(tmp, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, shape)
    (tmp / ".complete").write_text(VERSION)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a concurrent reader sees either no model or a whole one
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    ap.add_argument("--quiet", action="store_true", help="print nothing but errors")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the Llama's size")
    args = ap.parse_args(argv)
    path = build(force=args.force, shape=args.shape)
    if not args.quiet:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
