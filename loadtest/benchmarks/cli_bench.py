"""``cluster bench``: start a cluster from a config, run a workload against it, read its metrics,
write a JSON and a Markdown report under ``loadtest/results/`` — for one configuration or several
side by side (each started in turn, the same schedule sent to each).

    cluster bench --config configs/sim-local.yaml --workload mixed --rate 4 --duration 30
    cluster bench --variant cache=configs/sim-local.yaml --variant rr=my-rr.yaml --workload agent
    cluster bench --variants loadtest/my-variants.yaml --workload trace.jsonl
    cluster bench --url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:9100/metrics ...

(``loadtest`` is not an installed package: run it from the repository root as
``python -m cluster.cli bench …``, or ``PYTHONPATH=. cluster bench …``.)

Workloads (``--workload``): a surface (``tab``, ``chat``, ``agent``), ``mixed`` (6:3:1) or a mix
``tab=6,chat=3,agent=1`` — shapes from :mod:`loadtest.common.surfaces` at arrival times from
:mod:`loadtest.common.arrivals` (``--arrival poisson|gamma|uniform``, ``--rate``, ``--duration``,
``--cv``, ``--seed``); a JSONL trace (``*.jsonl``: records of :class:`RequestSpec` with ``t``);
or ``module:function`` / ``module:Class`` returning request specs
(:class:`loadtest.common.request_spec.RequestSpec`) or records of them — called with whichever of ``seed, n,
rate, duration_s, times, scale, context_window, model`` it accepts, a class then asked to
``generate(seed)``; ``shared-prefix`` is ``loadtest.common.workloads:SharedPrefixWorkload``. Specs
without an arrival time get the ``--arrival`` times in order.

Variants YAML::

    variants:
      - {name: cache-aware, config: configs/sim-local.yaml}
      - {name: round-robin, config: configs/sim-local.yaml, set: {backends.0.routing: round_robin}}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import inspect
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig, parse_config
from deployments.launcher.local import free_port
from loadtest.common import arrivals, runner
from loadtest.common.request_spec import RequestSpec
from loadtest.common.surfaces import SHAPES, parse_mix, schedule

RESULTS = Path(__file__).parents[1] / "results"


@dataclass
class Variant:
    name: str
    config: str | None  # None: an already running cluster (--url)
    overrides: dict[str, Any] = field(default_factory=dict)

    def load(self) -> ClusterConfig:
        assert self.config is not None
        raw = yaml.safe_load(os.path.expandvars(Path(self.config).read_text()))
        for path, value in self.overrides.items():
            set_path(raw, path, value)
        return parse_config(raw, source=f"{self.config} ({self.name})")


def set_path(obj: Any, dotted: str, value: Any) -> None:
    """``backends.0.routing`` → obj["backends"][0]["routing"] = value (lists by index)."""
    parts = dotted.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if isinstance(obj, list) else obj.setdefault(p, {})
    last = parts[-1]
    if isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value


def load_variants(args: argparse.Namespace) -> list[Variant]:
    out: list[Variant] = []
    if args.url:
        return [Variant(args.name or "running", None)]
    if args.config:
        out.append(Variant(args.name or Path(args.config).stem, args.config))
    for v in args.variant or []:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--variant wants name=path, got {v!r}")
        out.append(Variant(name, path))
    if args.variants:
        doc = yaml.safe_load(Path(args.variants).read_text()) or {}
        for i, item in enumerate(doc.get("variants") or []):
            if not isinstance(item, dict) or "name" not in item or "config" not in item:
                raise SystemExit(f"{args.variants}: variants[{i}] needs 'name' and 'config'")
            out.append(Variant(str(item["name"]), str(item["config"]), dict(item.get("set") or {})))
    if not out:
        raise SystemExit("give --config, --variant name=path, --variants FILE or --url")
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must differ: {names}")
    return out


# --- workloads ------------------------------------------------------------------------------------


def build_workload(args: argparse.Namespace, model: str, context_window: int | None) -> list[RequestSpec]:
    w = args.workload
    times = arrivals.arrivals(
        args.arrival, args.rate, duration_s=args.duration, n=args.requests, cv=args.cv, seed=args.seed
    )
    if w.endswith(".jsonl"):
        return [
            RequestSpec.from_record(r)
            for r in arrivals.read_trace(w, time_scale=args.time_scale, limit=args.requests)
        ]
    if ":" in w or w in ALIASES:
        return _from_function(w, args, times, model, context_window)
    return schedule(
        times,
        parse_mix(w),
        seed=args.seed,
        scale=args.scale,
        context_window=context_window,
        sessions_per_surface=args.sessions_per_surface,
    )


ALIASES = {"shared-prefix": "loadtest.common.workloads:SharedPrefixWorkload"}


def _from_function(
    ref: str, args: argparse.Namespace, times: list[float], model: str, context_window: int | None
) -> list[RequestSpec]:
    """A generator function, or a class with ``generate(seed)`` (e.g. ``SharedPrefixWorkload``)."""
    module, _, fn_name = ALIASES.get(ref, ref).partition(":")
    target = getattr(importlib.import_module(module), fn_name)
    offered = {
        "seed": args.seed,
        "n": len(times),
        "rate": args.rate,
        "duration_s": args.duration,
        "times": times,
        "scale": args.scale,
        "context_window": context_window,
        "model": model,
    }
    made = _call(target, offered)
    if hasattr(made, "generate"):
        made = _call(made.generate, offered)
    items = list(made)
    if args.requests is not None:
        items = items[: args.requests]
    specs: list[RequestSpec] = []
    for i, item in enumerate(items):
        spec, timed = coerce_spec(item)
        if not timed:
            spec.arrival_s = times[i] if i < len(times) else (times[-1] if times else 0.0)
        specs.append(spec)
    return sorted(specs, key=lambda s: s.arrival_s)


def _call(fn: Any, offered: dict[str, Any]) -> Any:
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in offered.items() if k in params})


def coerce_spec(item: Any) -> tuple[RequestSpec, bool]:
    """A generator's item as a RequestSpec: one already (a spec without a surface is sent as Chat),
    or a record (``t`` or ``arrival_s``, messages as any sequence; or an object's ``to_json()``);
    the flag says whether it came with an arrival time."""
    if isinstance(item, RequestSpec):
        return (item if item.surface is not None else replace(item, surface="chat")), True
    d = dict(item.to_json() if hasattr(item, "to_json") else item)
    if "arrival_s" in d and "t" not in d:
        d["t"] = d.pop("arrival_s")
    d.setdefault("kind", "chat" if "messages" in d else "completion")
    d["surface"] = d.get("surface") or "chat"
    return RequestSpec.from_record(d), "t" in d


def schedule_digest(specs: list[RequestSpec]) -> str:
    h = hashlib.sha256()
    for s in specs:
        h.update(json.dumps(s.to_record(), sort_keys=True).encode())
    return h.hexdigest()[:16]


# --- one variant ----------------------------------------------------------------------------------


def progress_printer(name: str) -> runner.Progress:
    tty = sys.stderr.isatty()
    last = {"t": -10.0}

    def show(st: dict[str, Any]) -> None:
        ttft = f"{st['ttft_p50_ms']:.0f} ms" if st["ttft_p50_ms"] is not None else "-"
        line = (
            f"[bench {name}] {st['elapsed_s']:6.1f}s  done {st['done']}/{st['total']}  "
            f"in flight {st['in_flight']}  errors {st['errors']}  TTFT p50 {ttft}"
        )
        if tty:
            sys.stderr.write("\r" + line.ljust(100))
            if st["done"] == st["total"]:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif st["elapsed_s"] - last["t"] >= 5 or st["done"] == st["total"]:
            last["t"] = st["elapsed_s"]
            print(line, file=sys.stderr, flush=True)

    return show


def _warmup(base_url: str, model: str, n: int) -> None:
    import httpx

    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"warm up {i}"}], "max_tokens": 4}
        try:
            httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
        except httpx.HTTPError as exc:
            print(f"[bench] warm-up request failed: {exc}", file=sys.stderr)


def _start_local(v: Variant, cfg: ClusterConfig) -> tuple[str, str]:
    """Start the variant's own local cluster; its API and metrics URLs."""
    from deployments.launcher import local

    port, mport = free_port(), free_port()
    # Ray pushes application metrics every 10 s by default; 1 s lets a short run be read.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    print(f"[bench {v.name}] starting {cfg.name} from {v.config} …", file=sys.stderr, flush=True)
    try:
        local.start(cfg, port=port, metrics_port=mport)
    except BaseException:
        with contextlib.suppress(Exception):  # a failed start must not leave Ray running
            local.stop()
        raise
    return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"


def run_variant(v: Variant, args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    cfg: ClusterConfig | None = None
    if v.config is None:
        base_url, metrics_url = args.url.rstrip("/"), args.metrics_url
    else:
        cfg = v.load()
        base_url, metrics_url = _start_local(v, cfg)
    startup_s = time.monotonic() - started
    try:
        model = args.model or (cfg.models[0].name if cfg else _first_model(base_url))
        window = cfg.model(model).context_window if cfg and cfg.model(model) else None
        slos = {s.name: s.ttft_slo_ms for s in cfg.surfaces} if cfg else {}
        slos = {n: slos.get(n, sh.ttft_slo_ms) for n, sh in SHAPES.items()} | slos
        specs = build_workload(args, model, window)
        if args.save_trace:
            path = args.save_trace.replace("{variant}", v.name)
            arrivals.write_trace(path, [s.to_record() for s in specs])
        _warmup(base_url, model, args.warmup)
        if metrics_url:
            time.sleep(args.metrics_settle_s)
        before = runner.scrape(metrics_url) if metrics_url else {}
        results, wall = asyncio.run(
            runner.run_schedule(
                base_url,
                model,
                specs,
                max_in_flight=args.max_in_flight,
                timeout_s=args.timeout,
                progress=None if args.no_progress else progress_printer(v.name),
            )
        )
        if metrics_url:
            time.sleep(args.metrics_settle_s)
        after = runner.scrape(metrics_url) if metrics_url else {}
    finally:
        if v.config is not None:
            from deployments.launcher import local

            local.stop()
    return {
        "name": v.name,
        "config": v.config,
        "overrides": v.overrides,
        "model": model,
        "startup_s": round(startup_s, 1),
        "schedule_sha": schedule_digest(specs),
        "summary": runner.summarize(results, wall, slos),
        "server": runner.server_summary(before, after),
        "requests": runner.result_rows(results) if args.per_request else None,
    }


def _first_model(base_url: str) -> str:
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]


# --- reports --------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"
    if isinstance(x, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in x.items()) or "-"
    return str(x)


_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("requests", ("requests",)),
    ("completed", ("completed",)),
    ("cancelled (client)", ("cancelled",)),
    ("errors", ("errors",)),
    ("errors by type", ("errors_by_type",)),
    ("goodput (TTFT within SLO)", ("goodput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("ITL p50 ms", ("itl_ms", "p50")),
    ("ITL p99 ms", ("itl_ms", "p99")),
    ("e2e p50 ms", ("e2e_ms", "p50")),
    ("e2e p99 ms", ("e2e_ms", "p99")),
    ("output tok/s (all)", ("output_tok_s",)),
    ("decode tok/s per stream p50", ("decode_tok_s_p50",)),
    ("cached / prompt tokens", ("cached_tokens",)),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)  # type: ignore[assignment]
    return d


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    failed = [v for v in report["variants"] if "error" in v]
    vs = [v for v in report["variants"] if "error" not in v]
    lines = [
        f"# Benchmark: {m['workload']} ({m['created']})",
        "",
        f"Arrivals {m['arrival']} at {m['rate']}/s for {m['duration_s']} s (seed {m['seed']}, "
        f"scale {m['scale']}); machine: {m['machine']}.",
        "",
        *[f"**{v['name']} failed**: `{v['error'][:300]}`\n" for v in failed],
        "| | " + " | ".join(v["name"] for v in vs) + " |",
        "|---|" + "---|" * len(vs),
    ]
    for label, path in _ROWS:
        cells = []
        for v in vs:
            x = _get(v["summary"]["overall"], path)
            if label.startswith("cached"):
                o = v["summary"]["overall"]
                x = f"{o['cached_tokens']:,} / {o['prompt_tokens']:,}"
            cells.append(_fmt(x))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    server_rows = [
        ("server TTFT p50/p99 ms (all)", lambda s: _server_ttft(s)),
        ("server prefix-cache hit rate", lambda s: s.get("prefix_cache_hit_rate")),
        ("server rejections", lambda s: s.get("rejections_by_code")),
        ("server routing reasons", lambda s: s.get("routing_by_reason")),
        ("server endings", lambda s: s.get("endings_by_outcome")),
    ]
    for label, fn in server_rows:
        cells = [_fmt(fn(v["server"]) if v["server"].get("available") else None) for v in vs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| schedule | " + " | ".join(v["schedule_sha"] for v in vs) + " |")
    lines.append("| startup s | " + " | ".join(_fmt(v["startup_s"]) for v in vs) + " |")
    surfaces = sorted({s for v in vs for s in v["summary"]["surfaces"]})
    for s in surfaces:
        lines += ["", f"## {s}", "", "| | " + " | ".join(v["name"] for v in vs) + " |"]
        lines.append("|---|" + "---|" * len(vs))
        for label, path in [
            ("requests", ("requests",)),
            ("SLO TTFT ms", ("slo_ttft_ms",)),
            ("goodput", ("goodput",)),
            ("good output tok/s", ("good_output_tok_s",)),
            ("TTFT p50 / p99 ms", ("ttft_ms",)),
            ("ITL p50 / p99 ms", ("itl_ms",)),
            ("e2e p50 ms", ("e2e_ms", "p50")),
            ("cancelled", ("cancelled",)),
            ("errors", ("errors_by_type",)),
        ]:
            cells = []
            for v in vs:
                x = _get(v["summary"]["surfaces"].get(s, {}), path)
                if isinstance(x, dict) and "p99" in x:
                    x = f"{_fmt(x['p50'])} / {_fmt(x['p99'])}"
                cells.append(_fmt(x))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _server_ttft(s: dict[str, Any]) -> str | None:
    rows = s.get("ttft_ms_by_surface") or {}
    if not rows:
        return None
    return "; ".join(f"{k} {_fmt(r.get('p50'))}/{_fmt(r.get('p99'))}" for k, r in rows.items())


def write_report(report: dict[str, Any], out_dir: Path, tag: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j, md = out_dir / f"bench-{tag}.json", out_dir / f"bench-{tag}.md"
    j.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    md.write_text(markdown(report))
    return j, md


def _tag(args: argparse.Namespace) -> str:
    if args.tag:
        return args.tag
    name = Path(args.workload).stem if args.workload.endswith(".jsonl") else args.workload
    w = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return f"{w}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"


def bench(args: argparse.Namespace) -> int:
    variants = load_variants(args)
    report: dict[str, Any] = {
        "meta": {
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "workload": args.workload,
            "arrival": args.arrival,
            "rate": args.rate,
            "cv": args.cv,
            "duration_s": args.duration,
            "requests_cap": args.requests,
            "seed": args.seed,
            "scale": args.scale,
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        },
        "variants": [],
    }
    for v in variants:
        try:
            report["variants"].append(run_variant(v, args))
        except Exception as exc:  # one broken variant must not lose the others' results
            print(f"[bench {v.name}] failed: {exc!r}", file=sys.stderr, flush=True)
            report["variants"].append({"name": v.name, "config": v.config, "error": repr(exc)[:1000]})
    j, md = write_report(report, Path(args.out_dir), _tag(args))
    print(markdown(report))
    print(f"[bench] wrote {j} and {md}", file=sys.stderr)
    errors = sum(v["summary"]["overall"]["errors"] for v in report["variants"] if "error" not in v)
    broken = any("error" in v for v in report["variants"])
    return 1 if broken or (args.fail_on_error and errors) else 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a workload against clusters started from configs; report")
    g = p.add_argument_group("what to benchmark")
    g.add_argument("--config", help="one cluster config (the variant is named after the file)")
    g.add_argument("--name", help="name of the --config or --url variant")
    g.add_argument("--variant", action="append", metavar="NAME=PATH", help="a config to compare (repeat)")
    g.add_argument("--variants", metavar="YAML", help="variants file: name, config, optional dotted 'set'")
    g.add_argument("--url", help="an already running cluster instead (no start/stop)")
    g.add_argument("--metrics-url", help="its Prometheus endpoint (with --url)")
    g.add_argument("--model", help="model to ask for (default: the config's first)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="mixed", help="tab|chat|agent|mixed|tab=6,chat=3|FILE.jsonl|mod:fn")
    w.add_argument("--arrival", default="poisson", choices=arrivals.KINDS)
    w.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    w.add_argument("--cv", type=float, default=2.0, help="gap coefficient of variation (gamma)")
    w.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    w.add_argument("--requests", type=int, default=None, help="at most this many requests")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output sizes")
    w.add_argument("--sessions-per-surface", type=int, default=8, help="live sessions interleaved")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed (0.5 = 2x rate)")
    w.add_argument("--save-trace", help="write the schedule as JSONL ({variant} is replaced)")
    r = p.add_argument_group("run")
    r.add_argument("--max-in-flight", type=int, default=256, help="client-side cap on open requests")
    r.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    r.add_argument("--warmup", type=int, default=2, help="sequential warm-up requests before the run")
    r.add_argument("--metrics-settle-s", type=float, default=2.5, help="wait for Ray's metrics push")
    r.add_argument("--out-dir", default=str(RESULTS))
    r.add_argument("--tag", help="report file name part (default: workload + time)")
    r.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--fail-on-error", action="store_true", help="exit 1 when any request failed")
    p.set_defaults(func=bench)
