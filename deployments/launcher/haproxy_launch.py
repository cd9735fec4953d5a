"""HAProxy as the local launcher runs it: Serve's own config, with our listeners and client limits.

Ray Serve 2.60 renders HAProxy's config from a fixed template (``ray/serve/_private/
haproxy_templates.py``) that binds the stats page (``bind *:<stats port>``) and the Prometheus
exporter (``bind :<metrics port>``) on every interface, without auth, opens the admin socket
``mode 666 level admin``, sets no ``timeout http-request`` and no per-client limit; none of these
has a setting (``RAY_SERVE_HAPROXY_*`` covers the ports, not the addresses or the socket's mode).
What Serve does let us choose is the binary (``RAY_SERVE_HAPROXY_BINARY_PATH``), which it starts as
``<binary> -db -f <config> ...`` at every start and reload. The local launcher points it at a small
script that runs this file, which rewrites that config in place (under Serve's own lock on it) and
then execs the real HAProxy with the same arguments: Serve sees its own HAProxy (same pid, same
command line), and the config on disk is the one HAProxy runs.

The rewrite (``rewrite``, pure): every listener Serve binds on all interfaces binds the configured
host; the admin socket gets mode 600 (its folder 0700); a client's request line and headers must
arrive within a deadline (past it HAProxy answers its own 408 and closes: the page comes from its
HTTP/1 layer, which has no stream yet and sends only its built-in pages, whatever ``errorfile``
says); one client address holds at most so many connections at once (more are refused as they
open, with a reset). And HAProxy's life is
tied to the Serve actor that started it (``PR_SET_PDEATHSIG``): a stop that kills that actor
without its clean-up (a process-group TERM of ``cluster serve``) no longer leaves an HAProxy
holding the API port.

Run as a script with ``python -I -S``: standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "# llmc:"  # on every line we add; a config that has it was rewritten already
_BIND = re.compile(r"^(\s*bind\s+)(\*|0\.0\.0\.0|::|)(:\d+)(.*)$")
_SOCKET = re.compile(r"^(\s*stats socket\s+\S+\s+)mode\s+\d+")
_WILDCARD = ("", "*", "0.0.0.0", "::")


@dataclass(frozen=True)
class Limits:
    """What the rewrite sets: where listeners bind, the header deadline, the per-client cap."""

    host: str
    header_timeout_ms: int
    max_conns_per_client: int | None = None


def rewrite(text: str, lim: Limits) -> str:
    """Serve's config with our listeners and limits (unchanged if it was rewritten already)."""
    if MARK in text:
        return text
    out: list[str] = []
    section = ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            section = line.strip()
        if section == "defaults" and line.strip().startswith("timeout http-request"):
            continue  # ours below wins: one deadline
        out.append(_listener(line, lim.host))
        if line.strip() == "defaults":
            out += _defaults(lim)
        elif section == "frontend http_frontend" and line.strip().startswith("bind "):
            out += _per_client(lim.max_conns_per_client)
    return "\n".join(out) + "\n"


def _listener(line: str, host: str) -> str:
    sock = _SOCKET.match(line)
    if sock:
        return f"{sock.group(1)}mode 600{line[sock.end() :]}"
    bind = _BIND.match(line)
    if bind and host not in _WILDCARD:
        return f"{bind.group(1)}{host}{bind.group(3)}{bind.group(4)}"
    return line


def _defaults(lim: Limits) -> list[str]:
    return [
        f"    {MARK} the request line and headers must arrive within this (Serve sets no deadline)",
        f"    timeout http-request {lim.header_timeout_ms}ms",
    ]


def _per_client(cap: int | None) -> list[str]:
    if cap is None:
        return []
    return [
        f"    {MARK} at most {cap} open connections per client address; more are refused as they open",
        "    stick-table type ipv6 size 100k expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {cap} }}",
    ]


def install(folder: Path, real: str, lim: Limits) -> Path:
    """Write the launcher Serve starts (``RAY_SERVE_HAPROXY_BINARY_PATH``) into ``folder`` (ours,
    mode 0700); returns its path."""
    args = ["--real", real, "--host", lim.host, "--header-timeout-ms", str(lim.header_timeout_ms)]
    if lim.max_conns_per_client is not None:
        args += ["--max-conns-per-client", str(lim.max_conns_per_client)]
    cmd = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), *args, "--"]
    launcher = folder / "haproxy"
    launcher.write_text(f'#!/bin/sh\nexec {shlex.join(cmd)} "$@"\n')
    launcher.chmod(0o700)
    return launcher


def _rewrite_file(config: str, lim: Limits) -> None:
    """Rewrite Serve's config in place, under the lock Serve writes it under."""
    folder = os.path.dirname(config)
    os.chmod(folder, 0o700)  # the admin socket's folder: ours alone
    with open(config + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        text = Path(config).read_text()
        new = rewrite(text, lim)
        if new != text:
            tmp = f"{config}.llmc-{os.getpid()}"
            Path(tmp).write_text(new)
            os.replace(tmp, config)


def _die_with_parent() -> None:
    """SIGTERM when the thread that started us (Serve's HAProxy manager) ends; kept across exec."""
    import ctypes

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the call above: nothing would signal us
        sys.exit(1)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="haproxy_launch")
    p.add_argument("--real", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--header-timeout-ms", type=int, required=True)
    p.add_argument("--max-conns-per-client", type=int, default=None)
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    lim = Limits(ns.host, ns.header_timeout_ms, ns.max_conns_per_client)
    if "-f" in args:
        _rewrite_file(args[args.index("-f") + 1], lim)
    _die_with_parent()
    os.execv(ns.real, [ns.real, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
