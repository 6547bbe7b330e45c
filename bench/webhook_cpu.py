"""The webhook dispatcher's CPU per delivered webhook: not the payment path, a measurement.

`payments worker` runs the dispatcher (app/workers/webhooks.py); this script
drives new payments from the client with a webhook endpoint at the fake
merchant for `--seconds`, waits until the dispatcher has delivered all of
them, and divides the worker process's CPU seconds (psutil's user + system)
over that span by the webhooks delivered in it. The worker's other loops run
too (their sweeps are a small, constant part: `idle` shows it).

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

from bench.load import Load
from bench.system import LOGS, console
from devtools.system import System

SERVICE_DATABASE = "payments_webhook_cpu"
RAILS_DATABASE = "payments_webhook_cpu_rails"


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def measure(api_url: str, api_key: str, service_url: str, worker_pid: int, seconds: float,
                  concurrency: int) -> dict[str, float]:
    conn = await asyncpg.connect(service_url)

    async def counts() -> tuple[int, int]:
        row = await conn.fetchrow("SELECT count(*) FILTER (WHERE state = 'delivered') AS delivered, "
                                  "count(*) FILTER (WHERE state = 'pending') AS pending FROM webhook_delivery")
        return row["delivered"], row["pending"]

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
            started = time.monotonic()
            result = await load.new_payments(seconds)
            await drained()
            elapsed = time.monotonic() - started
            after_cpu, (after_delivered, pending) = cpu_seconds(worker_pid), await counts()
    finally:
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
    }


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
        figures = asyncio.run(measure(api.url, api_key, service_url, worker.pid, seconds, concurrency))
    print(json.dumps({"label": label, **figures}), flush=True)


if __name__ == "__main__":
    typer.run(main)
