"""What the migration tests read from one streamed event: its ``data:`` line into the stream's
record (error, usage, role deltas, finish reasons, and the text when the record keeps it)."""

from __future__ import annotations

import json
from typing import Any


def take_data_line(out: dict[str, Any], line: str) -> None:
    ev = json.loads(line[6:])
    out["error"] = ev.get("error", out["error"])
    out["usage"] = ev.get("usage") or out["usage"]
    for ch in ev.get("choices", []):
        out["roles"] += "role" in ch["delta"]
        if "text" in out:
            out["text"].append(ch["delta"].get("content") or "")
        out["finish"] += [ch["finish_reason"]] if ch["finish_reason"] else []
