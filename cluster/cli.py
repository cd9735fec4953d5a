"""The ``cluster`` command: serve the local cluster, check a config, stream a demo answer, and the
ops subcommands (``k8s``, ``plan``, ``status``, ``bench``) that other modules add when present.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time

from cluster.config import ConfigError, load_config

# Subcommand modules: each has add_<name>_parser(subparsers). Missing ones are skipped, so the
# core stays importable on a machine without the ops extras.
_PLUGINS = (
    ("cluster.cli_k8s", "add_k8s_parser"),
    ("cluster.cli_plan", "add_plan_parser"),
    ("cluster.cli_status", "add_status_parser"),
    ("loadtest.cli_bench", "add_bench_parser"),
)


def _check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    print(
        f"{args.config}: ok — {len(cfg.models)} models, {len(cfg.backends)} backends, "
        f"{len(cfg.surfaces)} surfaces"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from deployments import local

    cfg = load_config(args.config)
    port = args.port or cfg.server.port
    mport = args.metrics_port or cfg.server.metrics_port
    api, prom = f"http://{cfg.server.host}:{port}", f"http://127.0.0.1:{mport}/metrics"
    print(f"[cluster] starting {cfg.name} from {args.config}: API {api}, metrics {prom} …", flush=True)
    t0 = time.monotonic()
    local.start(cfg, port=port, metrics_port=mport)
    print(f"[cluster] ready in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"[cluster] API      {api}/v1", flush=True)
    print(f"[cluster] metrics  {prom}   (Prometheus; `cluster status --watch` reads it)", flush=True)
    if args.demo:
        _stream_demo(f"http://{cfg.server.host}:{port}/v1", cfg.models[0].name, args.prompt)
    print(
        f"\n[cluster] serving. Try:\n  curl -N http://{cfg.server.host}:{port}/v1/chat/completions "
        "-H 'content-type: application/json' "
        f'-d \'{{"model": "{cfg.models[0].name}", "stream": true, '
        '"messages": [{"role": "user", "content": "Hello"}]}\''
    )
    if args.exit_after_demo:
        local.stop()
        return 0
    print("[cluster] Ctrl-C stops it.", flush=True)
    stop = False

    def _on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    while not stop:
        time.sleep(0.5)
    local.stop()
    return 0


def _stream_demo(base_url: str, model: str, prompt: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=os.environ.get("LLMC_API_KEY", "local"))
    print(
        f"\n[demo] streaming a chat completion from {model} (random weights: expect gibberish)\n> {prompt}\n"
    )
    t0 = time.perf_counter()
    ttft = None
    n = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            n += 1
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(
                f"\n\n[demo] {chunk.usage.completion_tokens} tokens, "
                f"TTFT {1000 * (ttft or 0):.0f} ms, {n} chunks"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cluster", description="LLM serving cluster on Ray Serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="validate a config file")
    p.add_argument("--config", required=True)
    p.set_defaults(func=_check)
    p = sub.add_parser("serve", help="start the local cluster (Ray + Serve) from a config")
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--port", type=int, default=None, help="API port (default: the config's server.port)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus port (default: server.metrics_port, 8080)"
    )
    p.add_argument("--demo", action="store_true", help="stream one answer once it is up")
    p.add_argument("--prompt", default="Write a Python function that reverses a string.")
    p.add_argument("--exit-after-demo", action="store_true", help="stop after the demo (CI, smoke checks)")
    p.set_defaults(func=_serve)
    for module, fn in _PLUGINS:
        try:
            getattr(importlib.import_module(module), fn)(sub)
        except ImportError:
            continue
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
