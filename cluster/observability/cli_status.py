"""``cluster status [--watch] [--url URL ...]``: a live table of the gateway and engine replicas,
read from the cluster's Prometheus endpoint (Ray's metrics agent on each node; the local cluster's
is ``server.metrics_port``). Against a remote cluster, pass each node's metrics URL.

The aggregation is ``cluster.observability.status`` (pure); this module fetches and draws.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import httpx

from cluster.config import load_config
from cluster.observability.prometheus import parse
from cluster.observability.status import P, Scrape, Status, Window

if TYPE_CHECKING:
    from rich.console import Group


def metrics_urls(args: argparse.Namespace) -> list[str]:
    """The ``--url`` values (``/metrics`` added to a bare host:port), else the config's port."""
    if not args.url:
        return [f"http://127.0.0.1:{load_config(args.config).server.metrics_port}/metrics"]
    out = []
    for u in args.url:
        u = u if "://" in u else "http://" + u
        out.append(u if u.rstrip("/").count("/") > 2 else u.rstrip("/") + "/metrics")
    return out


def scrape(urls: list[str], client: httpx.Client) -> Scrape:
    """One scrape of every node (their samples together); raises httpx.HTTPError when one fails."""
    samples = []
    for u in urls:
        r = client.get(u)
        r.raise_for_status()
        samples.extend(parse(r.text, prefix=P))
    return Scrape(time.monotonic(), tuple(samples))


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(status: Status, source: str) -> Group:
    """The status as rich renderables (a group of three tables)."""
    from rich.console import Group
    from rich.table import Table

    span = "since start" if status.window_s is None else f"last {status.window_s:.0f} s"
    gw = Table(title=f"gateway replicas ({span})", title_justify="left")
    for col in ("replica", "in flight", "waiting", "req/s", "TTFT p50 ms", "TTFT p99 ms"):
        gw.add_column(col, justify="left" if col == "replica" else "right")
    for g in status.gateways:
        gw.add_row(
            g.replica,
            str(g.in_flight),
            str(g.waiting),
            _f(g.rps, "{:.1f}"),
            _f(g.ttft_p50_ms),
            _f(g.ttft_p99_ms),
        )
    en = Table(title="engine replicas", title_justify="left")
    for col in ("backend", "replica", "running", "waiting", "KV use", "hit rate", "breaker", "req/s"):
        en.add_column(col, justify="left" if col in ("backend", "replica", "breaker") else "right")
    for e in status.engines:
        hit = _f(None if e.hit_rate is None else 100 * e.hit_rate, "{:.0f} %")
        en.add_row(
            e.backend, e.replica, str(e.running), str(e.waiting), f"{100 * e.kv_usage:.0f} %", hit,
            _breaker(e.breaker), _f(e.rps, "{:.1f}"),
        )  # fmt: skip
    be = Table(title="backends (first tokens/s and TTFT, at the gateway)", title_justify="left")
    for col in ("backend", "breaker", "req/s", "TTFT p50 ms", "TTFT p99 ms"):
        be.add_column(col, justify="left" if col in ("backend", "breaker") else "right")
    for b in status.backends:
        be.add_row(b.backend, _breaker(b.breaker), _f(b.rps, "{:.1f}"), _f(b.ttft_p50_ms), _f(b.ttft_p99_ms))
    return Group(f"[bold]llm-cluster[/bold] status from {source}", gw, en, be)


def _breaker(state: str) -> str:
    return state if state == "closed" else f"[bold red]{state}[/bold red]"


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    urls = metrics_urls(args)
    source = ", ".join(urls)
    console = Console()
    window = Window(span_s=args.window)
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            window.add(scrape(urls, client))
        except httpx.HTTPError as exc:
            console.print(f"[red]cannot read {source}: {exc}[/red] (is the cluster up? `cluster serve`)")
            return 1
        if not args.watch:
            console.print(render(window.status(), source))
            return 0
        with Live(render(window.status(), source), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(args.interval)
                    try:
                        window.add(scrape(urls, client))
                        live.update(render(window.status(), source))
                    except httpx.HTTPError as exc:
                        live.console.print(f"[red]scrape failed: {exc}[/red]")
            except KeyboardInterrupt:
                return 0


def add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="live table of gateway and engine replicas, from the metrics endpoint")
    p.add_argument("--config", default="configs/local.yaml", help="its server.metrics_port, without --url")
    p.add_argument(
        "--url",
        action="append",
        help="a node's metrics URL (repeat for each node), e.g. http://HOST:8080/metrics",
    )
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes with --watch")
    p.add_argument("--window", type=float, default=60.0, help="seconds the rates and quantiles cover")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape")
    p.set_defaults(func=_status)
