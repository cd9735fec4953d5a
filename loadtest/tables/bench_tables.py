"""BENCHMARKS.md's and RESULTS.md's tables, rendered from the result files
(``loadtest/results/*.json``), so that a figure on the page is a figure a benchmark script wrote,
not one copied by hand.

    python -m loadtest.tables.bench_tables            # rewrite every marked table in both pages
    python -m loadtest.tables.bench_tables --check    # exit 1 (and name them) if any table is stale

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; the prose around the
markers is hand-written and left alone. ``PAGES`` maps each page's table names to the pure functions
that render them; the rounding of each column is stated in that function. ``tests/unit/test_benchmarks_md.py``
checks that every marked region is what its renderer gives and that no table lies outside one.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from loadtest.tables import (
    tables_affinity,
    tables_control,
    tables_engine,
    tables_load,
    tables_prefill,
    tables_rehearsal,
    tables_relay,
    tables_reliability,
    tables_results,
    tables_summary,
    tables_tenants,
)
from loadtest.tables.table_format import ROOT, Results

BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
RESULTS_MD = ROOT / "RESULTS.md"

TABLES: dict[str, Callable[[Results], str]] = {
    "summary": tables_summary.summary,
    "engine-fidelity": tables_engine.engine_fidelity,
    "gpu-profiles": tables_engine.gpu_profiles,
    "planner-validation": tables_engine.planner_validation,
    "planner-real": tables_engine.planner_real,
    "affinity-micro": tables_engine.affinity_micro,
    "control-plane": tables_control.control_plane,
    "control-plane-fits": tables_control.control_plane_fits,
    "hedging": tables_engine.hedging,
    "hedging-window": tables_engine.hedging_window,
    "affinity-groups": tables_affinity.groups,
    "affinity-common-prompt": tables_affinity.common_prompt,
    "affinity-kv-pressure-live": tables_affinity.kv_pressure_live,
    "affinity-kv-pressure-virtual": tables_affinity.kv_pressure_virtual,
    "affinity-kv-pressure-seeds": tables_affinity.kv_pressure_seeds,
    "affinity-vllm": tables_affinity.affinity_vllm,
    "overhead": tables_load.overhead,
    "overhead-split": tables_load.overhead_split,
    "overhead-floor": tables_load.overhead_floor,
    "relay": tables_relay.relay,
    "relay-cpu": tables_relay.relay_cpu_summary,
    "faults-final": tables_reliability.faults_final,
    "soak": tables_reliability.soak,
    "overload": tables_load.overload,
    "overload-shared": tables_load.overload_shared,
    "overload-shared-vllm": tables_load.overload_shared_vllm,
    "noisy-neighbour": tables_tenants.noisy_neighbour,
    "prefill-avoid": tables_prefill.prefill_avoid,
    "prefill-avoid-shared": tables_prefill.prefill_avoid_shared,
    "migration": tables_reliability.migration,
    "warmup": tables_engine.warmup,
    "rehearsal": tables_rehearsal.rehearsal,
    "rehearsal-events": tables_rehearsal.rehearsal_events,
}

Renderers = dict[str, Callable[[Results], str]]
# Each page and its tables: RESULTS.md's one-page answers (loadtest/tables/tables_results.py), and here.
PAGES: dict[Path, Renderers] = {BENCHMARKS_MD: TABLES, RESULTS_MD: tables_results.TABLES}

REGION = re.compile(r"<!-- table:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.DOTALL)


def regions(text: str) -> dict[str, str]:
    """Each marked region's body (without its markers), by name; a name twice is an error."""
    found: dict[str, str] = {}
    for m in REGION.finditer(text):
        if m["name"] in found:
            raise ValueError(f"table '{m['name']}' is marked twice")
        found[m["name"]] = m["body"]
    return found


def render(name: str, results: Results, tables: Renderers = TABLES) -> str:
    return tables[name](results) + "\n"


def rewrite(
    text: str, results: Results, failures: dict[str, str] | None = None, tables: Renderers = TABLES
) -> str:
    """``text`` with every marked region replaced by its rendering; an unknown name is an error.

    With ``failures``, a table whose renderer fails (a result file missing, or rewritten in a shape
    the renderer does not know) keeps its old text and its error is recorded there, so one broken
    file does not hold back every other table after a long run.
    """
    unknown = set(regions(text)) - set(tables)
    if unknown:
        raise KeyError(f"no renderer for marked table(s): {', '.join(sorted(unknown))}")

    def one(m: re.Match[str]) -> str:
        name = m["name"]
        try:
            body = render(name, results, tables)
        except Exception as exc:
            if failures is None:
                raise
            failures[name] = f"{type(exc).__name__}: {exc}"
            body = m["body"]
        return f"<!-- table:{name} -->\n{body}<!-- /table:{name} -->"

    return REGION.sub(one, text)


def stale(text: str, results: Results, tables: Renderers = TABLES) -> list[str]:
    """The marked tables whose text is not what their result files render."""
    return [name for name, body in regions(text).items() if body != render(name, results, tables)]


def _page(path: Path, tables: Renderers, check: bool) -> int:
    """Check or rewrite one page; 1 where a table is stale (check) or could not be rendered."""
    text = path.read_text()
    results = Results()
    if check:
        names = stale(text, results, tables)
        for name in names:
            print(
                f"stale: {path.name}'s table '{name}' (run python -m loadtest.tables.bench_tables)",
                file=sys.stderr,
            )
        return 1 if names else 0
    failures: dict[str, str] = {}
    new = rewrite(text, results, failures, tables)
    changed = [name for name, body in regions(text).items() if body != regions(new)[name]]
    path.write_text(new)
    done = len(regions(new)) - len(failures)
    print(f"{path.name}: {done} tables rendered; changed: {', '.join(changed) or 'none'}")
    for name, error in failures.items():
        print(f"{path.name}'s table '{name}' not rendered (its old text kept): {error}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if a table is stale")
    args = ap.parse_args(argv)
    return max(_page(path, tables, args.check) for path, tables in PAGES.items())


if __name__ == "__main__":
    sys.exit(main())
