"""/metrics, read as Prometheus reads it, after real payments through real processes.

The API runs with `--workers 2`: each uvicorn process counts what it
answered in its own files, and `payments api` serves /metrics on a port of
its own (API_METRICS_PORT, never the public one), adding them all up
(app/observability/multiproc.py). So the counts here are checked against
what the test sent, scraped more than once, and split per process from the
files themselves, which must show that both processes counted.

The worker serves its own /metrics on a port of its own; what it counts is
checked after it recovers a crashed payment and while one is parked.
The metrics are parsed with prometheus_client's own text parser.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from app.config import Settings
from app.db.engine import build_engine
from app.db.transaction import read
from app.idempotency import key_table
from tests.support import claimed, headers, key_row, payment_body, until

PAYMENTS = "/v1/payments"
Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(http: httpx.AsyncClient, url: str) -> Samples:
    response = await http.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metrics_url(api) -> str:
    """Where `payments api` serves its /metrics: its own port (devtools/system.py gives each API one)."""
    return f"http://127.0.0.1:{api.env['API_METRICS_PORT']}"


def requests(samples: Samples, status: str, route: str = PAYMENTS, method: str = "POST") -> float:
    return value(samples, "payments_http_request_duration_seconds_count", route=route, method=method, status=status)


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def lease_expired(db, client_id: int, key: str) -> None:
    async def expired() -> bool:
        return await db.fetchval(
            "SELECT lease_expires_at < now() FROM idempotency_key WHERE client_id = $1 AND key = $2", client_id, key
        )

    await until(expired, "the dead owner's lease to expire")


async def crash(http, processes, acme, key: str, body: dict, point: str) -> None:
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT=point, LEASE_SECONDS="1")
    with pytest.raises(httpx.HTTPError):
        await http.post(doomed.url + PAYMENTS, json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137


def left_over_counts(directory: Path) -> None:
    """Files of an earlier `payments api` in `directory`: 1000 payments started, under another process id."""
    code = "from app.observability import metrics; metrics.STARTED.inc(1000)"
    subprocess.run([sys.executable, "-c", code], env={"PROMETHEUS_MULTIPROC_DIR": str(directory)}, check=True)
    assert list(directory.glob("counter_*.db"))


def per_process(directory: Path, status: str, route: str = PAYMENTS, method: str = "POST") -> list[float]:
    """Requests answered with `status`, as each process's own file counted them."""
    counts = []
    for path in sorted(directory.glob("histogram_*.db")):
        samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in MultiProcessCollector.merge([str(path)], accumulate=True)
            for s in family.samples
        }
        counts.append(requests(samples, status, route, method))
    return counts


async def both_processes_answering(url: str, directory: Path) -> list[float]:
    """Health checks until each of the two processes has answered some (read from their own files).

    uvicorn's second worker may still be starting when the first answers;
    once both have answered, the sums below are sums of two processes.
    """
    async def both() -> bool:
        # New connections each time: a kept-alive one stays with the process that accepted it.
        async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
            await asyncio.gather(*(fresh.get(url + "/healthz") for _ in range(4)))
        try:
            counts = per_process(directory, "200", route="/healthz", method="GET")
        except struct.error:
            # A process that is starting has created its file and not yet
            # written its header: it has answered nothing yet.
            return False
        return len(counts) == 2 and all(counts)

    await until(both, "both API processes to answer")
    return per_process(directory, "200", route="/healthz", method="GET")


async def test_two_api_processes_count_payments_replays_409s_422s_parks_and_a_takeover_as_one(
    http, stack, db, acme, processes, tmp_path
):
    directory = tmp_path / "metrics"
    directory.mkdir()
    left_over_counts(directory)  # emptied at start-up, or /metrics would count them
    api = processes.system.start_api("metered", args=("--workers", "2"), PROMETHEUS_MULTIPROC_DIR=str(directory),
                                     MAX_ATTEMPTS="1")
    url = api.url
    health = await both_processes_answering(url, directory)

    async def pay(key: str, body: dict) -> httpx.Response:
        return await http.post(url + PAYMENTS, json=body, headers=headers(acme, key))

    # A payment, then 20 retries of it at once: replays, by the shortcut.
    key, body = str(uuid.uuid4()), payment_body()
    first = await pay(key, body)
    assert first.status_code == 201
    replays = await asyncio.gather(*(pay(key, body) for _ in range(20)))
    assert {(r.status_code, r.headers.get("Idempotent-Replayed")) for r in replays} == {(201, "true")}
    # The same key with another body: 422.
    assert (await pay(key, body | {"amount": 9999})).status_code == 422
    # A retry while the first attempt waits on a slow PSP: 409.
    slow_key, slow = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "delay", "reference": slow["reference"], "seconds": 1.5})
    in_flight = asyncio.create_task(pay(slow_key, slow))
    await claimed(db, acme.id, slow_key)
    assert (await pay(slow_key, slow)).status_code == 409
    assert (await in_flight).status_code == 201
    # An API that died after the PSP charged: the retry here takes it over at EXT1_SENT.
    crashed_key, crashed = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, crashed_key, crashed, "after-call-EXT1")
    await lease_expired(db, acme.id, crashed_key)
    assert (await pay(crashed_key, crashed)).status_code == 201
    # A charge whose outcome stays unknown, with one attempt allowed: parked (202).
    parked_key, parked = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "error_before", "reference": parked["reference"], "status": 502})
    answer = await pay(parked_key, parked)
    assert answer.status_code == 202 and answer.json()["status"] == "indeterminate"
    # One read of a payment by id: counted under its route's template.
    payment_id = first.json()["id"]
    assert (await http.get(f"{url}{PAYMENTS}/{payment_id}", headers=acme.auth)).status_code == 200

    # Each process writes what its requests counted once a second
    # (app/observability/metrics.py::flush): wait for the other's last one.
    scrapes = 0

    async def counted() -> Samples | None:
        nonlocal scrapes
        scrapes += 1
        samples = await scrape(http, metrics_url(api))
        # Every answer made above, whichever process made it and flushed it last.
        made = tuple(requests(samples, status) for status in ("201", "409", "422", "202"))
        return samples if made == (1 + 20 + 1 + 1, 1, 1, 1) else None

    await until(counted, "both processes to have written their counts")
    for _ in range(4):  # scraped again and again, the same sums
        samples = await scrape(http, metrics_url(api))
        scrapes += 1
        assert value(samples, "payments_started_total") == 3  # not 1003: the old files were removed
        assert value(samples, "payments_finished_total", status="succeeded") == 3
        assert value(samples, "payments_replays_total", answered_by="shortcut") == 20
        assert value(samples, "payments_replays_total", answered_by="route") == 0
        assert value(samples, "payments_problems_total", problem="idempotency-key-reused") == 1
        assert value(samples, "payments_problems_total", problem="request-in-progress") == 1
        assert value(samples, "payments_takeovers_total", recovery_point="EXT1_SENT") == 1
        assert value(samples, "payments_parks_total", recovery_point="EXT1_SENT", cause="unknown") == 1
        assert requests(samples, "201") == 1 + 20 + 1 + 1
        assert (requests(samples, "409"), requests(samples, "422"), requests(samples, "202")) == (1, 1, 1)
        assert requests(samples, "200", route=f"{PAYMENTS}/{{payment_id}}", method="GET") == 1
        calls = {(dict(labels)["system"], dict(labels)["call"], dict(labels)["outcome"]): n
                 for (name, labels), n in samples.items()
                 if name == "payments_external_call_duration_seconds_count"}
        assert calls[("psp", "send", "applied")] == 2  # the first payment and the slow one
        assert calls[("psp", "send", "unknown")] == 1  # the parked one's charge: a 502
        assert calls[("psp", "probe", "not_found")] == 1  # ... and its inline probe
        assert calls[("psp", "probe", "applied")] == 1  # the takeover found the dead owner's charge
        assert calls[("rail", "send", "applied")] == 3  # and paid out all three

    # No label holds an id or a key: only templates.
    labels = {v for (_, pairs) in samples for _, v in pairs}
    assert not any(payment_id in v or key in v for v in labels)
    # The two processes' own files: what the scrapes added up.
    assert sum(per_process(directory, "201")) == 23
    assert len(health) == 2
    assert sum(per_process(directory, "200", route="/healthz", method="GET")) == requests(
        samples, "200", route="/healthz", method="GET")
    # The scrapes were not requests to the API: the public port never saw them.
    assert not any(dict(labels).get("route") == "/metrics" for (_, labels) in samples)
    # A process that stops writes what it had not yet: the requests of its
    # last second are in the files too.
    last = 5
    for _ in range(last):
        assert (await http.get(url + "/openapi.json")).status_code == 200
    api.stop()
    assert sum(per_process(directory, "200", route="/openapi.json", method="GET")) == last


async def test_the_worker_serves_its_own_metrics_of_what_it_recovered_and_what_is_parked(
    http, stack, db, acme, processes
):
    # A payment whose API died after recording the charge, left for the worker.
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-EXT2_SENT")
    # And one parked: one attempt allowed, and the rail's answer a 502.
    parked_key, parked = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.rail, {"action": "error_before", "reference": parked["reference"], "status": 502})
    parking = processes.api("parking", MAX_ATTEMPTS="1")
    answer = await http.post(parking.url + PAYMENTS, json=parked, headers=headers(acme, parked_key))
    assert answer.json()["status"] == "indeterminate"

    worker = processes.system.start_worker("metered worker", WORKER_MIN_AGE_SECONDS="0", WORKER_POLL_SECONDS="0.1",
                                           LEASE_SECONDS="1")
    url = f"http://127.0.0.1:{worker.env['WORKER_METRICS_PORT']}"

    async def recovered() -> bool:
        return (await key_row(db, acme.id, key))["state"] == "finished"

    await until(recovered, "the worker to finish the crashed payment")
    samples: Samples = {}

    async def reported() -> bool:
        nonlocal samples
        samples = await scrape(http, url)
        # The takeover and the finish are the engine's counts, written within
        # a second (app/observability/metrics.py::flush).
        return value(samples, "payments_worker_recoveries_total", result="finished") == 1 \
            and value(samples, "payments_parked_operations") == 1 \
            and value(samples, "payments_takeovers_total", recovery_point="EXT2_SENT") == 1 \
            and value(samples, "payments_finished_total", status="succeeded") == 1

    await until(reported, "the worker to report the recovery and the parked payment")
    assert value(samples, "payments_worker_backlog") == 0
    assert value(samples, "payments_worker_lag_seconds") == 0
    assert value(samples, "payments_unfinished_operations") == 0
    assert value(samples, "payments_worker_sweeps_total", result="ok") >= 1
    assert value(samples, "payments_worker_sweeps_total", result="failed") == 0
    assert time.time() - value(samples, "payments_worker_last_sweep_timestamp_seconds") < 30
    assert value(samples, "payments_reconciliation_runs_total", result="finished") >= 1
    assert value(samples, "process_resident_memory_bytes") > 0  # the standard process metrics, beside ours
    # Nothing of the API's request metrics: the worker answers no payment requests.
    assert not any(name.startswith("payments_http_") for name, _ in samples)


async def test_the_backlog_is_what_a_sweep_would_take_and_how_long_the_oldest_has_waited(
    http, stack, db, acme, processes, database_url
):
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-EXT1_SENT")
    await lease_expired(db, acme.id, key)
    engine = build_engine(Settings(database_url=database_url))
    try:
        backlog = await read(engine, key_table.backlog, min_age=0)
        assert (backlog.due, backlog.unfinished, backlog.parked) == (1, 1, 0)
        assert backlog.oldest_due_seconds > 0
        # Younger than WORKER_MIN_AGE_SECONDS: the sweep would not take it yet, so it is not due.
        assert (await read(engine, key_table.backlog, min_age=3600)).due == 0
    finally:
        await engine.dispose()


async def test_metrics_are_not_on_the_public_port_but_on_their_own(http, stack, acme, processes):
    api = processes.api("metered-default")
    response = await http.post(api.url + PAYMENTS, json=payment_body(), headers=headers(acme, str(uuid.uuid4())))
    assert response.status_code == 201

    # Anyone who reaches the API would read every route's rates and every
    # problem's count: the public port does not serve them.
    public = await http.get(api.url + "/metrics")
    assert public.status_code == 404
    assert public.headers["content-type"] == "application/problem+json"

    async def counted() -> bool:
        return requests(await scrape(http, metrics_url(api)), "201") == 1

    await until(counted, "the payment to be counted on the metrics port")


def test_a_taken_api_metrics_port_refuses_to_start_the_api(processes):
    api = processes.system.api_process("blocked")
    with socket.create_server(("127.0.0.1", int(api.env["API_METRICS_PORT"]))):
        result = subprocess.run(api.argv, env=api.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "API_METRICS_PORT" in result.stderr


async def test_payments_api_refuses_nothing_and_serves_no_metrics_with_metrics_disabled(http, stack, acme, processes):
    api = processes.api("unmetered", METRICS_ENABLED="false")
    assert (await http.get(api.url + "/metrics")).status_code == 404
    with pytest.raises(httpx.ConnectError):
        await http.get(metrics_url(api) + "/metrics")
    response = await http.post(api.url + PAYMENTS, json=payment_body(), headers=headers(acme, str(uuid.uuid4())))
    assert response.status_code == 201


def test_a_taken_metrics_port_refuses_to_start_the_worker(processes):
    worker = processes.system.worker_process("blocked")
    with socket.create_server(("127.0.0.1", int(worker.env["WORKER_METRICS_PORT"]))):
        result = subprocess.run(worker.argv, env=worker.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "WORKER_METRICS_PORT" in result.stderr
