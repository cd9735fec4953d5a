"""Image parts counted the way each provider documents it, from the image's own header."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from cluster.tokens import images as I


def _data_url(w: int, h: int, fmt: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_the_size_comes_from_the_images_header(fmt: str) -> None:
    assert I.image_size(_data_url(1024, 333, fmt)) == (1024, 333)


def test_openai_tiles_as_documented() -> None:
    # OpenAI's own examples: 1024 x 1024 high -> 768 x 768, 4 tiles, 765 tokens; 2048 x 4096 ->
    # 1024 x 2048 -> 768 x 1536, 6 tiles, 1105 tokens; detail low is 85 whatever the size.
    assert I.openai_tokens((1024, 1024)) == 765
    assert I.openai_tokens((2048, 4096)) == 1105
    assert I.openai_tokens((4096, 8192), "low") == 85
    assert I.openai_tokens((100, 100)) == 255  # small images are not scaled up: one tile
    assert I.openai_tokens(None) == I.OPENAI_MAX == 1445


def test_anthropic_pixels_over_750_as_documented() -> None:
    assert I.anthropic_tokens((200, 200)) == 54  # the docs' table: 200 x 200 is ~54 tokens
    assert I.anthropic_tokens((1000, 1000)) == 1334  # ~1,334
    assert I.anthropic_tokens((1092, 1092)) == 1590  # ~1,590: the largest square kept as is
    assert I.anthropic_tokens((4000, 3000)) == I.ANTHROPIC_MAX  # scaled down, capped
    assert I.anthropic_tokens(None) == I.ANTHROPIC_MAX


def test_a_chats_images_by_provider() -> None:
    url = _data_url(1000, 1000, "PNG")
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}],
        },
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}],
        },
    ]
    assert I.image_tokens(messages, "anthropic") == 1334 + I.ANTHROPIC_MAX
    assert I.image_tokens(messages, "openai") == 765 + 85
    assert I.image_tokens([{"role": "user", "content": "no images"}], "openai") == 0
    assert I.image_size("data:image/png;base64,@@not-base64@@") is None
