"""The lab's network: a bridge, a network namespace per node with a veth pair to the bridge and an
address on a private subnet inside the namespace only (the host's end has none, IPv6 off), and
the processes that live in those namespaces. Linux only, as root (``ip`` of iproute2).

Nothing here routes anywhere: the bridge is attached to no interface of the host, the namespaces
have no default route, so the lab's traffic stays between its namespaces; and the host gets an
``unreachable`` route for the subnet, so that a request made from the host's own namespace by
mistake fails at once (without it, it would leave by the default route). ``in_netns`` runs a
function in a thread that has joined a namespace (a network namespace is per thread), which is
how the lab's own requests reach the nodes from the client namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from cluster.k8s.lab_plan import TAG_ENV, LabError, LabNode, is_lab_link, is_lab_netns

T = TypeVar("T")
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> str:
    """``ip`` with these arguments; its output (an error names the command and its message)."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def check_subnet_free(subnet: str) -> None:
    """Refuse a subnet that any interface or route of the host already uses."""
    net = ipaddress.ip_network(subnet)
    for a in json.loads(ip("-j", "addr") or "[]"):
        for info in a.get("addr_info", []):
            if info.get("family") == "inet" and net.overlaps(
                ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False)
            ):
                raise LabError(f"{subnet} is in use on {a['ifname']} ({info['local']}): not creating the lab")
    for r in json.loads(ip("-j", "route") or "[]"):
        dst = r.get("dst", "default")
        if dst != "default" and net.overlaps(ipaddress.ip_network(dst, strict=False)):
            raise LabError(f"{subnet} overlaps the route {dst} on {r.get('dev')}: not creating the lab")


def _no_ipv6(ifname: str) -> None:
    """No IPv6 (not even link-local) on a host-side interface of the lab: no address of ours there."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")


def guard_subnet(subnet: str) -> None:
    """An ``unreachable`` route for the subnet on the host: a request made from the host's own
    namespace by mistake fails at once instead of leaving by the default route."""
    ip("route", "add", "unreachable", subnet)


def guarded(subnet: str) -> list[str]:
    """The lab's guard route, if it is there."""
    routes = json.loads(ip("-j", "route", "show", "type", "unreachable") or "[]")
    return [r["dst"] for r in routes if r.get("dst") == subnet]


def unguard_subnet(subnet: str) -> None:
    ip("route", "del", "unreachable", subnet, check=False)


def create_bridge(bridge: str) -> None:
    ip("link", "add", bridge, "type", "bridge")
    _no_ipv6(bridge)
    ip("link", "set", bridge, "up")


def create_node_net(node: LabNode, bridge: str, prefixlen: int, peer: str) -> None:
    """The node's namespace, loopback up, and ``eth0`` on the bridge with the node's address."""
    ns = node.netns
    ip("netns", "add", ns)
    ip("link", "add", node.veth, "type", "veth", "peer", "name", peer)
    _no_ipv6(node.veth)
    ip("link", "set", node.veth, "master", bridge)
    ip("link", "set", node.veth, "up")
    ip("link", "set", peer, "netns", ns)
    ip("-n", ns, "link", "set", peer, "name", "eth0")
    ip("-n", ns, "addr", "add", f"{node.ip}/{prefixlen}", "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")


# Finding what is ours ------------------------------------------------------------------------
def lab_namespaces() -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(p.name for p in NETNS_DIR.iterdir() if is_lab_netns(p.name))
    return []


def lab_links() -> list[str]:
    """The lab's bridge and the host ends of its veth pairs (and any peer not moved yet)."""
    return sorted(
        link["ifname"] for link in json.loads(ip("-j", "link") or "[]") if is_lab_link(link["ifname"])
    )


def _netns_id(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        st = path.stat()
        return st.st_dev, st.st_ino
    return None


def _environ_has(pid: int, tag: str) -> bool:
    with contextlib.suppress(OSError):
        return f"{TAG_ENV}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return False


def lab_pids(namespaces: Iterable[str], tag: str | None) -> list[int]:
    """Every process in one of these namespaces, or carrying the lab's tag in its environment (one
    whose namespace is gone already); never this process."""
    ids = {i for ns in namespaces if (i := _netns_id(NETNS_DIR / ns)) is not None}
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        pid = int(d.name)
        if _netns_id(d / "ns" / "net") in ids or (tag is not None and _environ_has(pid, tag)):
            out.append(pid)
    return sorted(out)


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


def kill_all(pids: Iterable[int], grace_s: float = 5.0, first: int = signal.SIGTERM) -> list[int]:
    """``first`` (TERM), then KILL what is still there after ``grace_s``; returns the pids that
    were alive."""
    pids = [p for p in pids if _alive(p)]
    for sig, wait_s in ((first, grace_s), (signal.SIGKILL, 5.0)):
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait_s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    return pids


def remove_net(namespaces: Iterable[str], links: Iterable[str]) -> None:
    """Delete the namespaces, then the links (a veth's peer goes with it; the bridge last)."""
    for ns in namespaces:
        ip("netns", "del", ns, check=False)
    for link in sorted(links, key=lambda name: name.startswith("llmc-lab")):
        ip("link", "del", link, check=False)


# Joining a namespace -------------------------------------------------------------------------
def in_netns(netns: str, fn: Callable[[], T], timeout_s: float = 120.0) -> T:
    """``fn()`` in a thread of its own that has joined ``netns`` (its sockets are made there)."""
    value: list[T] = []  # fn's result, or
    error: list[BaseException] = []  # what it raised: handed to the caller

    def run() -> None:
        try:
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(fd)
            value.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    t = threading.Thread(target=run, name=f"netns-{netns}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"a call in {netns} took over {timeout_s:g} s")
    if error:
        raise error[0]
    return value[0]
