"""`payments worker`: the process that runs the background jobs beside the API.

Where it sits: beside the API, over the same services (app/services.py).
`run` starts four loops: the recovery sweep (recovery.py), reconciliation's
schedule (reconciliation.py), the key table's daily upkeep (retention.py)
and the webhook dispatcher (webhooks.py); durable ticks make each schedule
run once per window across all workers. SIGTERM or SIGINT stops all four
(`main`). A database that is down makes each loop back off, never exit; a
metrics port that is taken refuses start-up, so no worker runs unwatched.
docs/request-path.md#the-recovery-worker says what the loops share.
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
from app.workers.refund_settlement import settlement_loop
from app.workers.recovery import recovery_loop
from app.workers.retention import retention_loop
from app.workers.webhooks import dispatch_loop

log = logging.getLogger(__name__)


async def run(settings: Settings, stop: asyncio.Event) -> None:
    async with open_services(settings) as services:
        log.info("worker started: recovery sweep, reconciliation schedule, refund settlement, key partition upkeep, "
                 "webhook dispatcher")
        await asyncio.gather(
            recovery_loop(services, stop),
            reconcile_loop(services, stop),
            settlement_loop(services, stop),
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
