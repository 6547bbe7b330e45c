"""Development tooling, not the payment path: a private network of namespaces, so a node can be cut off.

Used by devtools/ha.py when `make soak-ha` partitions the primary
(docs/failover.md#a-real-partition); nothing in app/ imports it. On loopback
every node shares one network, and the closest thing to a partition is a
frozen process. Here each PostgreSQL node (its Patroni and its PostgreSQL)
runs in a network namespace of its own, whose one interface is the inner end
of a veth pair; the outer end is a port of a bridge in the machine's own
namespace, where etcd, HAProxy and the service reach the nodes at the
bridge's address:

    root namespace:  bridge payha-br 10.231.27.1 ── etcd, HAProxy (and the service, through HAProxy)
                        ├── veth payha-pg1 ──▶ namespace payha-pg1: eth0 10.231.27.11 (Patroni, PostgreSQL)
                        ├── veth payha-pg2 ──▶ namespace payha-pg2: eth0 10.231.27.12
                        └── veth payha-pg3 ──▶ namespace payha-pg3: eth0 10.231.27.13

`cut(node)` sets the outer end of the node's veth down: the cable pulled.
Its processes keep running and its own address still answers inside its
namespace, but nothing crosses to etcd, to the other nodes or to HAProxy.
`restore(node)` sets it up again.

The namespaces have no default route and the bridge forwards only between
its own ports: no packet of theirs leaves the machine. The names all start
with `payha-`; a lock file says whose they are, so a run that finds them
from an earlier run that crashed removes them, and a run that finds them
held by a run still going refuses to start.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

PREFIX = "payha-"
BRIDGE = PREFIX + "br"
# A private /24 that nothing on this machine routes; refused at start if something does.
SUBNET = ipaddress.ip_network("10.231.27.0/24")
GATEWAY = SUBNET[1]  # the bridge's own address: etcd and HAProxy are reached at it, and reach from it
LOCK = Path("/run/lock/payments-ha-netns.lock")
CLONE_NEWNET = 0x40000000


def program(name: str) -> str | None:
    """A program's path; also where root's programs live when they are not on PATH (a user's PATH)."""
    return shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin", "/usr/bin")
                                       if os.access(f"{d}/{name}", os.X_OK)), None)


IP = program("ip") or "ip"
SETPRIV = program("setpriv") or "setpriv"


def why_not() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, no setpriv); None if they can."""
    if os.geteuid() != 0:
        return "not root: making network namespaces and veth pairs needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for name, package in (("ip", "iproute2"), ("setpriv", "util-linux")):
        if program(name) is None:
            return f"no `{name}` (apt-get install {package})"
    probe = subprocess.run([IP, "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Network:
    """The bridge, one namespace per node and the veth pairs between them; `up()`, then `down()` (always)."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.gateway = str(GATEWAY)
        self.addresses = {name: str(SUBNET[11 + n]) for n, name in enumerate(nodes)}
        self.subnet = str(SUBNET)
        self._lock: IO[str] | None = None

    @staticmethod
    def namespace(node: str) -> str:
        """The node's namespace, and the name of its veth's outer end (a link, another kind of name)."""
        return PREFIX + node

    def up(self) -> None:
        self._take_lock()
        remove_leftovers()
        taken = [line for line in ip("-4", "-o", "addr", "show").stdout.splitlines()
                 if ipaddress.ip_interface(line.split()[3]).network.overlaps(SUBNET)]
        taken += ip("-4", "route", "show", "root", str(SUBNET)).stdout.splitlines()
        if taken:
            raise RuntimeError(f"{SUBNET} is already in use on this machine, so it cannot be ours: {taken}")
        # forward_delay 0: a port set up again (a restored link) forwards at once.
        ip("link", "add", BRIDGE, "type", "bridge", "forward_delay", "0")
        ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        for node, address in self.addresses.items():
            name = self.namespace(node)
            ip("netns", "add", name)
            ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("link", "set", name, "master", BRIDGE, "up")
            ip("-n", name, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")

    def down(self) -> None:
        """Everything `up` made, gone (the processes inside must be stopped first); safe to call twice."""
        try:
            remove_leftovers()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def _take_lock(self) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        lock = LOCK.open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"another run holds {LOCK}: its {PREFIX}* namespaces are in use") from None
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    # -- the partition ----------------------------------------------------------

    def cut(self, node: str) -> None:
        """The node's cable pulled: the outer end of its veth down."""
        ip("link", "set", self.namespace(node), "down")

    def restore(self, node: str) -> None:
        ip("link", "set", self.namespace(node), "up")

    def restore_all(self) -> None:
        for node in self.nodes:
            self.restore(node)

    def is_cut(self, node: str) -> bool:
        return "state DOWN" in ip("link", "show", self.namespace(node)).stdout

    def inside(self, node: str, workers: int = 2) -> ThreadPoolExecutor:
        """Threads of ours that have entered the node's namespace: a socket they open is opened in it,
        so what they reach is what the node's own processes reach (its address; nothing else while cut)."""
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.namespace(node),
                                  initializer=_enter, initargs=(self.namespace(node),))


def _enter(namespace: str) -> None:
    """Move the calling thread (only it: a network namespace is per thread) into `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")


def remove_leftovers(timeout: float = 15) -> None:
    """Every `payha-*` namespace and link, gone, with any process still inside a namespace.

    Called before `up` (an earlier run that crashed, SIGKILLed, leaves them
    behind, and its Patroni and PostgreSQL still running in them) and by
    `down`. The caller holds the lock, so none of them belongs to a live run.
    Removing a namespace only unnames it: the kernel frees it, and the veth
    in it, once its last process has gone and in its own time, hence the wait."""
    namespaces = [line.split()[0] for line in ip("netns", "list").stdout.splitlines()]
    for name in (n for n in namespaces if n.startswith(PREFIX)):
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        ip("netns", "del", name, check=False)
    deadline = time.monotonic() + timeout
    while True:
        # `ip -o link` lines read "6: payha-pg1@if2: <...>": the name, and its peer's index.
        links = [name for name in (line.split(":")[1].strip().split("@")[0]
                                   for line in ip("-o", "link", "show").stdout.splitlines())
                 if name.startswith(PREFIX)]
        if not links:
            return
        for link in links:
            ip("link", "del", link, check=False)
        if time.monotonic() > deadline:
            raise RuntimeError(f"links left behind after {timeout:.0f} s: {links}")
        time.sleep(0.1)  # until the kernel has freed them, bounded by the deadline

