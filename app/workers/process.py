"""`payments worker`: the process that runs the background jobs beside the API.

Four loops share one set of services: the recovery sweep (every second or
so), the reconciliation schedule (which, every `reconcile_every_seconds`,
tries to claim each closed day of the booking horizon up to yesterday), the
key table's upkeep (which, every `key_reap_every_seconds`, tries to claim
today's: partitions created ahead, those past retention dropped) and the
webhook dispatcher (app/workers/webhooks.py); the durable tick makes the two
schedules once per window across all workers. SIGTERM or SIGINT stops all
four; in-flight payments release their leases, in-flight webhooks let theirs
run out (and are sent again).

Nothing else stops them: a database that is down (at start-up too: the pools
connect on first use) or restarting makes each loop log one line and back off,
never exit (app/workers/recovery.py::recovery_loop, reconciliation.py::reconcile_loop,
webhooks.py::dispatch_loop).

Its metrics (docs/operations.md) are served on WORKER_METRICS_HOST and
WORKER_METRICS_PORT by a thread of prometheus_client's, from the start: a
port that is taken refuses start-up (exit 2) rather than leave a worker that
nobody can watch.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from app.config import Settings
from app.observability import metrics
from app.services import open_services
from app.workers.reconciliation import reconcile_loop
from app.workers.recovery import recovery_loop
from app.workers.retention import retention_loop
from app.workers.webhooks import dispatch_loop

log = logging.getLogger(__name__)


async def run(settings: Settings, stop: asyncio.Event) -> None:
    async with open_services(settings) as services:
        log.info("worker started: recovery sweep, reconciliation schedule, key partition upkeep, webhook dispatcher")
        await asyncio.gather(
            recovery_loop(services, stop),
            reconcile_loop(services, stop),
            retention_loop(services, stop),
            dispatch_loop(services, stop),
        )
        log.info("worker stopped")


def main(settings: Settings) -> bool:
    """Run until SIGTERM or SIGINT; False if it could not start (its metrics port is taken)."""
    stop_serving = lambda: None  # noqa: E731
    if settings.metrics_enabled:
        metrics.worker()  # registered before the first scrape, so every series is there from the start
        try:
            stop_serving = metrics.serve(settings.worker_metrics_host, settings.worker_metrics_port)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%s (WORKER_METRICS_PORT): %s",
                      settings.worker_metrics_host, settings.worker_metrics_port, exc.strerror or exc)
            return False
        log.info("metrics on http://%s:%s/metrics", settings.worker_metrics_host, settings.worker_metrics_port)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop)

    try:
        # uvloop, as uvicorn gives the API: the dispatcher's POSTs and the
        # loops' statements spend less CPU in the event loop on it.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(go())
    finally:
        stop_serving()
    return True
