"""What an image part costs in prompt tokens, the way each provider documents it. Pure.

OpenAI (the tile models, gpt-4o and kin): ``detail: low`` is 85 tokens; otherwise the image is
scaled to fit in 2048 x 2048, then so that its shortest side is at most 768 px, and costs 170 per
512 px tile plus 85. Anthropic: ``width * height / 750`` after scaling the long edge down to 1,568
px, at most about 1,600 tokens. The size is read from a ``data:`` URL's image header (PNG, GIF,
JPEG, WebP); an image we cannot measure (an http(s) URL, a header we do not know) costs the most
one image can under that provider's rule, so window checks and budget reservations never count
low. The provider's reported usage settles the budget afterwards.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Iterable

from cluster.json_types import JSONObject

OPENAI_LOW = 85
OPENAI_MAX = 170 * 8 + 85  # 768 x 2048 after scaling: 2 x 4 tiles
ANTHROPIC_MAX = 1600
_HEAD_CHARS = 87_384  # base64 of the first 64 KiB: where a JPEG's frame header sits in practice


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a base64 ``data:`` URL's image, or None when unknown."""
    if not url.startswith("data:") or ";base64," not in url:
        return None
    head = url.split(";base64,", 1)[1][:_HEAD_CHARS]
    try:
        data = base64.b64decode(head[: len(head) // 4 * 4])
    except (binascii.Error, ValueError):
        return None
    try:
        return _png(data) or _gif(data) or _webp(data) or _jpeg(data)
    except (struct.error, IndexError):
        return None


def _png(d: bytes) -> tuple[int, int] | None:
    return struct.unpack(">II", d[16:24]) if d[:8] == b"\x89PNG\r\n\x1a\n" else None


def _gif(d: bytes) -> tuple[int, int] | None:
    return struct.unpack("<HH", d[6:10]) if d[:6] in (b"GIF87a", b"GIF89a") else None


def _webp(d: bytes) -> tuple[int, int] | None:
    if d[:4] != b"RIFF" or d[8:12] != b"WEBP":
        return None
    kind = d[12:16]
    if kind == b"VP8 ":
        w, h = struct.unpack("<HH", d[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L":
        b0, b1, b2, b3 = d[21:25]
        return 1 + (((b1 & 0x3F) << 8) | b0), 1 + (((b3 & 0xF) << 10) | (b2 << 2) | ((b1 & 0xC0) >> 6))
    if kind == b"VP8X":
        return 1 + int.from_bytes(d[24:27], "little"), 1 + int.from_bytes(d[27:30], "little")
    return None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(d: bytes) -> tuple[int, int] | None:
    if d[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(d) and d[i] == 0xFF:
        marker = d[i + 1]
        if marker in _SOF:
            h, w = struct.unpack(">HH", d[i + 5 : i + 9])
            return w, h
        i += 2 + struct.unpack(">H", d[i + 2 : i + 4])[0]
    return None


def openai_tokens(size: tuple[int, int] | None, detail: str | None = None) -> int:
    if detail == "low":
        return OPENAI_LOW
    if size is None:
        return OPENAI_MAX
    w, h = size
    fit = min(1.0, 2048 / max(w, h, 1))
    fw, fh = w * fit, h * fit
    short = min(1.0, 768 / max(min(fw, fh), 1))
    tiles = math.ceil(fw * short / 512) * math.ceil(fh * short / 512)
    return 170 * tiles + 85


def anthropic_tokens(size: tuple[int, int] | None) -> int:
    if size is None:
        return ANTHROPIC_MAX
    w, h = size
    fit = min(1.0, 1568 / max(w, h, 1))
    return min(math.ceil(w * fit * h * fit / 750), ANTHROPIC_MAX)


def image_parts(messages: Iterable[JSONObject]) -> list[JSONObject]:
    """The ``image_url`` objects of chat messages (as dumped: dicts)."""
    out = []
    for m in messages:
        content = m.get("content")
        for p in content if isinstance(content, list) else []:
            if isinstance(p, dict) and p.get("type") == "image_url" and isinstance(p.get("image_url"), dict):
                out.append(p["image_url"])
    return out


def image_tokens(messages: Iterable[JSONObject], api: str) -> int:
    """The prompt tokens of a chat's images for a provider API (``openai`` or ``anthropic``)."""
    total = 0
    for image in image_parts(messages):
        size = image_size(str(image.get("url") or ""))
        total += anthropic_tokens(size) if api == "anthropic" else openai_tokens(size, image.get("detail"))
    return total
