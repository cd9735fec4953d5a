"""Fill-in-the-middle prompts for self-hosted engines, in the model's own FIM tokens. Pure.

A Tab request is ``/v1/completions`` with ``prompt`` (the code before the cursor) and ``suffix``
(the code after it). A self-hosted engine gets one prompt: the model's prefix token, the prefix,
its suffix token, the suffix, its middle token (``psm``, the order most code models were trained
on), or suffix first (``spm``); the model then writes the middle. Providers that take ``suffix``
natively get it as sent, never this rendering.
"""

from __future__ import annotations

from cluster.config import FimTemplate


def render(t: FimTemplate, prefix: str, suffix: str) -> str:
    if t.order == "spm":
        return f"{t.suffix}{suffix}{t.prefix}{prefix}{t.middle}"
    return f"{t.prefix}{prefix}{t.suffix}{suffix}{t.middle}"
