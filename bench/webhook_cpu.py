"""The webhook dispatcher's CPU per delivered webhook: not the payment path, a measurement.

`payments worker` runs the dispatcher (app/workers/webhooks.py); this script
drives new payments from the client with a webhook endpoint at the fake
merchant for `--seconds`, waits until the dispatcher has delivered all of
them, and divides the worker process's CPU seconds (its CPU clock,
bench/costs.py::cpu_of) over that span by the webhooks delivered in it.
The worker's other loops run too (their sweeps are a small, constant
part: `idle` shows it). Delivered is the merchant's word: the webhooks
its inbox applied (bench/outbox.py), not the service's
`webhook_delivery` rows, which a delivery that succeeded need not leave.

Every process listens on a port given here (`--port-base` and the next five),
on the embedded PostgreSQL of EMBEDDED_PG_PORT / PAYMENTS_DATA_DIR, in
databases of their own (`payments_webhook_cpu`, `payments_webhook_cpu_rails`),
so it runs beside a test run or another bench. `--app-dir` runs the worker
(only the worker) on another copy of `app/` (say, main's, for a before/after):

    git archive main app | tar -x -C /tmp/before
    python -m bench.webhook_cpu --app-dir /tmp/before
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import asyncpg
import psutil
import typer

from bench import outbox
from bench.load import Load
from bench.costs import STATS_SETTLE_SECONDS, cpu_of
from bench.system import LOGS, console
from devtools.system import System

SERVICE_DATABASE = "payments_webhook_cpu"
RAILS_DATABASE = "payments_webhook_cpu_rails"


def cpu_seconds(pid: int) -> float:
    return cpu_of(psutil.Process(pid)) or 0.0


async def measure(api_url: str, api_key: str, service_url: str, merchant_url: str, client_id: int, worker_pid: int,
                  seconds: float, concurrency: int) -> dict[str, float]:
    conn = await asyncpg.connect(service_url)
    merchant = await asyncpg.connect(merchant_url)

    async def counts() -> tuple[int, int]:
        """The webhooks the merchant has applied, and the client's events it has not (bench/outbox.py)."""
        pending = await outbox.backlog(conn, merchant, client_id)
        return await outbox.applied(merchant), pending

    async def drained(limit: float = 60) -> None:
        deadline = time.monotonic() + limit
        while (await counts())[1] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # polling the backlog, bounded by the deadline

    try:
        async with Load(api_url, api_key, concurrency) as load:
            await load.new_payments(3.0)  # warm-up: connections, caches, the JIT of nothing
            await drained()
            idle_from = cpu_seconds(worker_pid)
            await asyncio.sleep(5)
            idle = (cpu_seconds(worker_pid) - idle_from) / 5
            before_cpu, (before_delivered, _) = cpu_seconds(worker_pid), await counts()
            before_db = await database_work(conn)
            started = time.monotonic()
            result = await load.new_payments(seconds)
            # Waiting on the merchant's database alone: a read of the service's would count in its figures.
            deadline = time.monotonic() + 60
            while await outbox.applied(merchant) < before_delivered + result.succeeded:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)  # polling the merchant's inbox, bounded by the deadline
            elapsed = time.monotonic() - started
            after_cpu = cpu_seconds(worker_pid)
            # Backends publish their counters when idle, within STATS_SETTLE_SECONDS.
            await asyncio.sleep(STATS_SETTLE_SECONDS)
            after_db = await database_work(conn)
            after_delivered, pending = await counts()
    finally:
        await merchant.close()
        await conn.close()
    delivered = after_delivered - before_delivered
    cpu = after_cpu - before_cpu
    return {
        "payments": result.succeeded,
        "payments_per_s": round(result.per_second, 1),
        "delivered": delivered,
        "pending_after": pending,
        "worker_cpu_s": round(cpu, 3),
        "idle_cpu_s_per_s": round(idle, 4),
        "cpu_ms_per_webhook": round(cpu / delivered * 1000, 4) if delivered else None,
        "cpu_ms_per_webhook_less_idle": round((cpu - idle * elapsed) / delivered * 1000, 4) if delivered else None,
        # The service database's work per payment with its webhook, every process's (the API's and the
        # worker's; the worker's other loops too): counters the machine's speed does not move.
        "service_db_per_payment": {
            name: round((after_db[name] - before_db[name]) / result.succeeded, 2) if result.succeeded else None
            for name in after_db
        },
    }


# Counted for the service's database alone (the fakes' is another database on the same server).
_DATABASE_WORK = """
    SELECT blks_hit + blks_read AS blocks, tup_inserted + tup_updated + tup_deleted AS rows_written,
           xact_commit AS commits
      FROM pg_stat_database WHERE datname = current_database()
"""


async def database_work(conn: asyncpg.Connection) -> dict[str, int]:
    return dict(await conn.fetchrow(_DATABASE_WORK))


def main(
    seconds: float = typer.Option(30.0, help="Seconds of new payments."),
    concurrency: int = typer.Option(16, help="Concurrent clients."),
    port_base: int = typer.Option(55720, help="The first of six consecutive ports."),
    app_dir: Path | None = typer.Option(None, help="Run the worker on this copy of app/ (its parent on PYTHONPATH)."),
    label: str = typer.Option("", help="A name for the run, printed with its figures."),
) -> None:
    psp_port, rail_port, merchant_port, api_port, metrics_port = range(port_base, port_base + 5)
    with System(LOGS / "webhook_cpu") as system:
        system.start_postgres()
        rails_url = system.create_database(RAILS_DATABASE, migrate=False)
        service_url = system.create_database(SERVICE_DATABASE)
        system.create_client("bench")
        client_id, api_key = system.create_client("bench-webhooks")
        system.start_fakes(records_url=rails_url, psp_port=psp_port, rail_port=rail_port)
        from app.outbox.endpoints import new_secret

        secret = new_secret()
        system.start_merchant(port=merchant_port, records_url=rails_url, secrets=[secret])

        async def register() -> None:
            conn = await asyncpg.connect(service_url)
            try:
                await conn.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                                   client_id, system.merchant.url + "/webhooks", system.seal(secret))
            finally:
                await conn.close()

        asyncio.run(register())
        api = system.start_api(port=api_port, METRICS_ENABLED="true", LOG_LEVEL="INFO", LOG_FORMAT="json")
        worker = system.worker_process(WORKER_METRICS_PORT=str(metrics_port), METRICS_ENABLED="true",
                                       LOG_LEVEL="INFO", LOG_FORMAT="json")
        if app_dir is not None:
            worker.env["PYTHONPATH"] = str(app_dir.resolve())
        system.spawn(worker)
        console.print(f"worker pid {worker.pid}" + (f" on {app_dir}" if app_dir else ""))
        figures = asyncio.run(measure(api.url, api_key, service_url, rails_url, client_id, worker.pid, seconds,
                                      concurrency))
    print(json.dumps({"label": label, **figures}), flush=True)


if __name__ == "__main__":
    typer.run(main)
