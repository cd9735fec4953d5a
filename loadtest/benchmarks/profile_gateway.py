"""Where a gateway replica's CPU goes under relay load (issue 44: cut the per-chunk and per-request
cost guided by a profile): py-spy samples every gateway replica while the relay benchmark's load runs.

    python -m loadtest.benchmarks.profile_gateway [--path provider|engine|floor] [--streams 256]
        [--chunks 200] [--interval-ms 20] [--seconds 20] [--out /tmp/llmc-profile]

Loopback only; the same processes as ``loadtest/benchmarks/bench_relay.py`` (a paced fake OpenAI upstream, our
cluster with its provider backend and a paced sim engine), started here and stopped here. The load
is ``--streams`` workers sending one streamed request after another for the sampled time plus a
warm-up; ``--path floor`` samples the benchmark's no-logic relay (its ``floor`` leg) instead, the
same shape without our code, to hold a profile of ours against. py-spy (``pip install py-spy``; it
needs ptrace, so run as root or with ``kernel.yama.ptrace_scope=0``) writes collapsed stacks per
replica under ``--out``; the summary printed is self time by function (where the CPU is spent) and
inclusive time by function (what a whole call costs), over every replica. A diagnosis tool: it
records no benchmark figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deployments.launcher.local import free_port
from loadtest.benchmarks.bench_relay import SIM_MODEL, body, relay_config
from loadtest.common.overhead_client import HOST, MODEL, client_session, run_jobs
from loadtest.common.overhead_cluster import OursCluster
from loadtest.common.procs import Proc, relay_pids, wait_http


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def summarise(stacks: list[Path], top: int) -> str:
    """Self and inclusive samples by function over collapsed-stack files (``a;b;c 12`` lines)."""
    own, incl, total = Counter[str](), Counter[str](), 0
    for path in stacks:
        for line in path.read_text(errors="replace").splitlines():
            frames, _, count = line.rpartition(" ")
            if not frames or not count.isdigit():
                continue
            n, names = int(count), frames.split(";")
            total += n
            own[names[-1]] += n
            for name in set(names):
                incl[name] += n
    out = [f"{total} samples over {len(stacks)} replica(s)", "", "self %  function"]
    out += [f"{100 * n / max(total, 1):6.1f}  {name}" for name, n in own.most_common(top)]
    out += ["", "incl %  function"]
    out += [f"{100 * n / max(total, 1):6.1f}  {name}" for name, n in incl.most_common(top)]
    return "\n".join(out)


async def _load(url: str, payload: bytes, streams: int, seconds: float) -> tuple[int, int]:
    """``streams`` workers for ``seconds``: (requests answered, requests failed)."""
    jobs = [[payload]] * (streams * 10_000)
    async with client_session() as session:
        batch = await run_jobs(session, url, jobs, streams, seconds)
    ok = sum(1 for s in batch.samples if s.ok)
    return ok, len(batch.samples) - ok


def _record(
    pids: list[int], seconds: float, out: Path, native: bool, gil: bool
) -> list[subprocess.Popen[bytes]]:
    spy = _py_spy()
    procs = []
    for pid in pids:
        cmd = [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250"]
        cmd += ["--format", "raw", "--output", str(out / f"gateway-{pid}.txt")]
        cmd += ["--native"] if native else ["--nonblocking"]  # native stacks pause the process
        cmd += ["--gil"] if gil else []
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("gateway-*.txt"):
        old.unlink()
    logdir = Path(tempfile.mkdtemp(prefix="llmc-profile-"))
    up_port, port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        cmd = [sys.executable, "-m", "loadtest.common.fake_upstream", "--port", str(up_port)]
        cmd += ["--chunks", str(args.chunks), "--interval-ms", str(args.interval_ms)]
        up = stack.enter_context(Proc("fake-upstream", cmd, logdir))
        wait_http(f"http://{HOST}:{up_port}/health", up, 30)
        cfg = relay_config(up_port, port, args.streams)
        floor = args.path == "floor"  # the no-logic relay of the same shape (loadtest/common/serve_floor.py)
        upstream = f"http://{HOST}:{up_port}/v1/chat/completions" if floor else None
        ours = OursCluster("ours", cfg, port, logdir, floor_upstream=upstream)
        stack.callback(ours.stop)
        ours.wait_ready(180)
        engine = args.path == "engine"
        payload = body(SIM_MODEL if engine else MODEL, args.chunks, ignore_eos=engine)
        pids = relay_pids(ours.tag)["floor" if floor else "gateway"]
        url = (ours.floor_url if floor else None) or ours.url
        print(f"{args.path} replicas {pids}; warming {args.warm_s:.0f} s", flush=True)
        asyncio.run(_load(url, payload, args.streams, args.warm_s))
        spies = _record(pids, args.seconds, out, args.native, args.gil)
        t0 = time.monotonic()
        ok, failed = asyncio.run(_load(url, payload, args.streams, args.seconds + 2))
        for spy in spies:
            _, err = spy.communicate(timeout=60)
            if spy.returncode:
                print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-400:]}")
        print(f"{ok} requests answered, {failed} failed in {time.monotonic() - t0:.1f} s")
    shutil.rmtree(logdir, ignore_errors=True)
    print(summarise(sorted(out.glob("gateway-*.txt")), args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=["provider", "engine", "floor"], default="provider")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warm-s", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--native", action="store_true", help="C frames too (py-spy --native)")
    ap.add_argument(
        "--gil",
        action="store_true",
        help="only samples holding the GIL (py-spy --gil): a thread waiting for it is not counted",
    )
    ap.add_argument("--out", default="/tmp/llmc-profile")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main(argv=None))
