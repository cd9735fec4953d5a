"""``cluster serve``: start the local cluster (Ray + Serve) from a config, optionally stream one demo
answer, and keep serving until Ctrl-C. Registered with ``cluster`` through the ``llm_cluster.cli``
entry points (pyproject.toml), so the core's CLI does not import the Serve shell.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from cluster.config import load_config
from deployments.launcher import local


def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="start the local cluster (Ray + Serve) from a config")
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--port", type=int, default=None, help="API port (default: the config's server.port)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus port (default: server.metrics_port, 8080)"
    )
    p.add_argument("--demo", action="store_true", help="stream one answer once it is up")
    p.add_argument("--prompt", default="Write a Python function that reverses a string.")
    p.add_argument("--exit-after-demo", action="store_true", help="stop after the demo (CI, smoke checks)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    port = args.port or cfg.server.port
    mport = args.metrics_port or cfg.server.metrics_port
    api, prom = f"http://{cfg.server.host}:{port}", f"http://127.0.0.1:{mport}/metrics"
    # Ctrl-C or SIGTERM from here on stops the cluster cleanly. A KeyboardInterrupt in the middle
    # of the start-up was sometimes lost inside Ray (a Ctrl-C 8 s in left the cluster serving), and
    # where it was not, it left a half-started cluster to Ray's exit hooks: the signal is noted
    # instead, the start-up runs to its end, and the cluster is stopped right after it.
    stop = _note_signals()
    print(f"[cluster] starting {cfg.name} from {args.config}: API {api}, metrics {prom} …", flush=True)
    t0 = time.monotonic()
    local.start(cfg, port=port, metrics_port=mport)
    print(f"[cluster] ready in {time.monotonic() - t0:.0f} s", flush=True)
    if stop.is_set():
        print("[cluster] stopping: a stop signal came during the start-up", flush=True)
        local.stop()
        return 130
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
    if not args.exit_after_demo:
        print("[cluster] Ctrl-C stops it.", flush=True)
        while not stop.wait(0.5):
            pass
    local.stop()
    return 0


def _note_signals() -> threading.Event:
    """SIGINT and SIGTERM set the returned event (and say so) instead of raising."""
    stop = threading.Event()

    def _on_signal(*_: object) -> None:
        if not stop.is_set():
            print("\n[cluster] stopping …", flush=True)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    return stop


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
