"""The code's shape at a git revision, in the figures issue 43 asks for before and after a
restructuring: Python files and lines per package, ``Any`` in the core, ``getattr(`` probes in
``deployments/``, ``# type: ignore`` lines, and the configuration's knobs (leaf fields of
``ClusterConfig``, counted from that revision's own code).

    python scripts/structure_stats.py [REV ...]      # default: HEAD

Each revision is read from a temporary ``git worktree`` (removed afterwards); nothing is run but
the import of that revision's ``cluster.config`` in a child process to count its fields.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("cluster", "deployments")
ANY = re.compile(r"\bAny\b")

_KNOBS = """
import sys, typing
from pydantic import BaseModel
sys.path.insert(0, sys.argv[1])
from cluster.config import ClusterConfig

def leaves(model, seen):
    n = 0
    for name, field in model.model_fields.items():
        inner = [a for a in typing.get_args(field.annotation) or (field.annotation,)
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        for a in typing.get_args(field.annotation):
            inner += [b for b in typing.get_args(a) if isinstance(b, type) and issubclass(b, BaseModel)]
        if inner and inner[0] not in seen:
            n += leaves(inner[0], seen | {inner[0]})
        else:
            n += 1
    return n

print(leaves(ClusterConfig, {ClusterConfig}))
"""


def _code_lines(path: Path) -> list[str]:
    """Lines that are code: no blank lines, no comment lines, no docstring lines (a rough cut)."""
    out, in_doc = [], False
    for line in path.read_text(errors="replace").splitlines():
        s = line.strip()
        if s.startswith(('"""', "'''")):
            if not (len(s) > 3 and s.endswith(s[:3])):
                in_doc = not in_doc
            continue
        if in_doc or not s or s.startswith("#"):
            continue
        out.append(line)
    return out


def stats(tree: Path) -> dict[str, object]:
    files: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    anys = getattrs = ignores = 0
    for top in (*CORE, "loadtest"):
        for path in sorted((tree / top).rglob("*.py")):
            rel = path.relative_to(tree)
            package = "/".join(rel.parts[:2]) if len(rel.parts) > 2 else rel.parts[0] + " (flat)"
            files[package] += 1
            text = path.read_text(errors="replace")
            lines[package] += text.count("\n")
            if top in CORE:
                code = _code_lines(path)
                anys += sum(len(ANY.findall(x)) for x in code)
                ignores += sum("# type: ignore" in x for x in code)
                if top == "deployments":
                    getattrs += sum(x.count("getattr(") for x in code)
    knobs = subprocess.run(
        [sys.executable, "-c", _KNOBS, str(tree)], capture_output=True, text=True, check=False
    )
    return {
        "packages": {p: {"files": files[p], "lines": lines[p]} for p in sorted(files)},
        "any_in_core": anys,
        "getattr_in_deployments": getattrs,
        "type_ignores_in_core": ignores,
        "config_knobs": int(knobs.stdout.strip()) if knobs.returncode == 0 else knobs.stderr[-300:],
    }


def at(rev: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="llmc-shape-") as tmp:
        tree = Path(tmp) / "tree"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "-q", "--detach", str(tree), rev], check=True)
        try:
            return {"rev": rev, **stats(tree)}
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)


def main(argv: list[str]) -> int:
    for rev in argv or ["HEAD"]:
        print(json.dumps(at(rev), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
