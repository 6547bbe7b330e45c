"""The batch round of `make bench` (and all of `make bench-batch`): a 10,000-row payroll file beside HTTP payments.

The question it answers: does a row of a payment batch, which travels over
the broker and is paid by `payments consume`, cost about what a payment sent
over HTTP costs? The target is rows/s at least 0.9x the HTTP new-payment
rate measured in the same run, on the same machine, against the same
database and fakes: a row makes a few round trips an HTTP payment does not
(its row read, its link to its payment, the broker's fetch and ack), and
saves the HTTP request and answer. Beside it, the time a client waits from
its upload to `batch.completed`.

    start a phased API (one process), a NATS server from the wheel (its
    store in a fresh directory) and `payments consume` (one process, as
    many rows at once as the HTTP round has clients)
    HTTP before: warm-up, then a measured run of new payments; the exactly-once check
    the batch alone: POST /v1/payment-batches with the file (the upload
    timed), then wait for its `batch.completed` event; rows/s is the rows
    over the time from the 202 to that event (publishing, paying and the
    completion sweep all inside it): the time a client waits
    HTTP after: the same as before
    side by side, the judged ratio: a second file of as many rows, paid
    while the HTTP clients pay new payments at the same moments, each with
    as many in flight; rows/s over HTTP payments/s. The ratio of the runs
    one after the other is printed too, but a machine shared with other
    work moves it by more than the target's margin between one run and the
    next, as it moves the bench's other targets judged side by side
    (bench/watching.py, bench/outbox.py)
    the checks: every row of both files one payment, one charge, one
    transfer, its ledger balanced, linked to its row; one `batch.completed`
    each; the HTTP runs' exactly-once check

And the CPU each payment costs, by process (the API, the consumer, the
bench's own load generator, the fakes), for the why behind the rates.
One process against one process, at the same number of payments in flight:
what the comparison holds equal. Everything else is the bench's own
(bench/system.py); `python -m bench.batches` runs this round alone, on
databases of its own, and `make bench` runs it after its other rounds
(bench/run.py).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import psutil
import typer

from app.payments.batches.rows import natural_key, payment_reference
from bench import report
from bench.checks import Check, _charges_and_transfers, _fetch, exactly_once
from bench.costs import cpu_of
from bench.load import Load
from bench.system import (
    LOGS, PHASED, RESULTS, SETTINGS, Databases, Service, apis, console, database_server, fakes, prepare_databases, running,
)
from devtools.bodies import payment_body
from devtools.system import System

ROWS = 10_000
VALUE_DATE = date(2026, 12, 24)
# How often the round looks for `batch.completed`: small beside the seconds a batch takes.
POLL_SECONDS = 0.1
# The HTTP clients' runs beside the batch: short, so the last one ends soon after the batch does.
SLICE_SECONDS = 2.0


def payroll(rows: int, tag: str) -> bytes:
    """A CSV payroll file of `rows` rows, each a payment that succeeds (the bench's one payment body)."""
    body = payment_body("row")
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["reference", "value_date", "amount", "currency", "card_token", "beneficiary_name",
                     "beneficiary_iban"])
    for n in range(1, rows + 1):
        writer.writerow([f"{tag}-{n:05d}", VALUE_DATE.isoformat(), body["amount"], body["currency"],
                         body["card_token"], body["beneficiary"]["name"], body["beneficiary"]["iban"]])
    return out.getvalue().encode()


def cpu_seconds(processes: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU seconds so far of each named group of processes (`cpu_of`; 0 for one that is gone)."""
    spent = {}
    for name, group in processes.items():
        spent[name] = sum(s for process in group if (s := cpu_of(process)) is not None)
    return spent


def per_payment_ms(before: dict[str, float], after: dict[str, float], payments: int) -> dict[str, float | None]:
    return {name: round((after[name] - before[name]) * 1000 / payments, 2) if payments else None for name in after}


async def http_round(api: Service, dbs: Databases, concurrency: int, warmup: float, duration: float,
                     watched: dict[str, list[psutil.Process]]) -> tuple[dict[str, Any], list[Check]]:
    async with Load(api.url, dbs.api_key, concurrency) as load:
        await load.new_payments(warmup)
        cpu = cpu_seconds(watched)
        result = await load.new_payments(duration)
        spent = per_payment_ms(cpu, cpu_seconds(watched), result.succeeded)
    checks = await exactly_once(PHASED, dbs.service_url, dbs.rails_url, dbs.client_id, result)
    return result.summary() | {"cpu_ms_per_payment": spent}, checks


async def upload_and_wait(api: Service, dbs: Databases, body: bytes, reference: str, timeout: float
                          ) -> dict[str, Any]:
    """POST the file; wait for its `batch.completed`. Wall-clock seconds of each step, and the batch's id."""
    conn = await asyncpg.connect(dbs.service_url)
    try:
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            async with http.post(f"{api.url}/v1/payment-batches", params={"reference": reference}, data=body,
                                 headers={"Authorization": f"Bearer {dbs.api_key}",
                                          "Idempotency-Key": str(uuid.uuid4()),
                                          "Content-Type": "text/csv"}) as r:
                answer = await r.text()
                if r.status != 202:
                    raise RuntimeError(f"the upload was answered {r.status}: {answer[:500]}")
            accepted = time.monotonic()
        batch_id = uuid.UUID(json.loads(answer)["id"])
        deadline = accepted + timeout
        while not await conn.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'"
                                      " AND data::jsonb ->> 'id' = $1", str(batch_id)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} not completed within {timeout:g} s")
            await asyncio.sleep(POLL_SECONDS)
        completed = time.monotonic()
        # The paying itself, from the database's clock: the first row's payment
        # created to the last one's finished.
        first, last = await conn.fetchrow(
            "SELECT min(p.created_at), max(k.finished_at) FROM payment_batch_row r"
            " JOIN payment p ON p.id = r.payment_id"
            " JOIN idempotency_key k ON k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)"
            " WHERE r.batch_id = $1", batch_id)
    finally:
        await conn.close()
    return {"batch_id": str(batch_id), "upload_s": round(accepted - started, 3),
            "accepted_to_completed_s": round(completed - accepted, 3),
            "upload_to_completed_s": round(completed - started, 3),
            "paying_s": round((last - first).total_seconds(), 3) if first and last else None}


async def batch_checks(dbs: Databases, batch_id: str, rows: int, tag: str, reference: str) -> list[Check]:
    """Every row one payment (succeeded, linked to its row), one charge, one transfer, a balanced ledger; one event."""
    references = [payment_reference(natural_key(dbs.client_id, reference, f"{tag}-{n:05d}", VALUE_DATE))
                  for n in range(1, rows + 1)]
    payments, ledger, linked, events = await _fetch(
        dbs.service_url,
        ("SELECT p.reference, p.id, p.status, p.amount_minor, p.net_minor FROM payment p"
         " JOIN unnest($1::text[]) AS r(reference) USING (reference) WHERE p.client_id = $2",
         (references, dbs.client_id)),
        ("SELECT l.payment_id, sum(l.debit_minor) AS debits, sum(l.credit_minor) AS credits FROM ledger_entry l"
         " JOIN payment p ON p.id = l.payment_id JOIN unnest($1::text[]) AS r(reference) USING (reference)"
         " GROUP BY l.payment_id", (references,)),
        ("SELECT count(*) AS rows, count(DISTINCT payment_id) AS payments FROM payment_batch_row"
         " WHERE batch_id = $1 AND payment_id IS NOT NULL", (uuid.UUID(batch_id),)),
        ("SELECT count(*) AS n FROM event WHERE type = 'batch.completed' AND data::jsonb ->> 'id' = $1", (batch_id,)),
    )
    charged, paid_out, charges, transfers = await _charges_and_transfers(dbs.rails_url, references)
    per_reference: dict[str, int] = {}
    for p in payments:
        per_reference[p["reference"]] = per_reference.get(p["reference"], 0) + 1
    succeeded = sum(1 for p in payments if p["status"] == "succeeded")
    unbalanced = sum(1 for r in ledger if r["debits"] != r["credits"])
    return [
        Check("every row one payment, succeeded", len(per_reference) == rows and succeeded == rows
              and all(n == 1 for n in per_reference.values()),
              f"{rows} rows, {len(payments)} payments, {succeeded} succeeded"),
        Check("every row linked to its own payment", linked[0]["rows"] == linked[0]["payments"] == rows,
              f"{linked[0]['rows']} rows linked to {linked[0]['payments']} payments"),
        Check("one PSP charge and one rail transfer per row", len(charged) == len(paid_out) == rows
              and all(n == 1 for n in charged.values()) and all(n == 1 for n in paid_out.values()),
              f"{len(charges)} charges, {len(transfers)} transfers for {rows} rows"),
        Check("each row's ledger balances", len(ledger) == rows and unbalanced == 0,
              f"{len(ledger)} payments posted, {unbalanced} unbalanced"),
        Check("batch.completed once", events[0]["n"] == 1, f"{events[0]['n']} events"),
    ]


async def measure(dbs: Databases, psp: Service, rail: Service, *, rows: int = ROWS, concurrency: int = 32,
                  duration: float = 20.0, warmup: float = 3.0, consumers: int = 1) -> dict[str, Any]:
    """The round: its own API, broker and consumers, on the bench's databases and fakes. Its figures (JSON)."""
    api = apis(dbs.service_url, psp, rail, 1)[PHASED]
    api.name = "batch round API (1w)"
    api.log = LOGS / "batch-round-api.log"
    store = Path(tempfile.mkdtemp(prefix="payments-bench-nats-"))
    system = System(LOGS / "batch-round")
    system.database_url, system.psp, system.rail = dbs.service_url, psp, rail
    with running([api]), system:
        with console.status("batch round: starting a NATS server and the consumers"):
            system.start_nats(store / "nats", url=None)
            # Watched as the API is (bench/system.py's SETTINGS): its logs cost what the API's do.
            for n in range(1, consumers + 1):
                system.start_consumer(f"consumer-{n}", BATCH_CONSUMER_CONCURRENCY=str(max(1, concurrency // consumers)),
                                      **SETTINGS[PHASED])
        # Whose CPU each payment costs: the API, the consumers, the bench itself (the HTTP load generator;
        # while the batch is paid it only polls), the fakes.
        watched = {"API": api.tree(), "consumers": [psutil.Process(p.pid) for p in system.processes
                                                    if p.name.startswith("consumer")],
                   "bench (load generator)": [psutil.Process()], "fakes": psp.tree() + rail.tree()}
        with console.status(f"batch round: HTTP new payments before, {duration:g} s, {concurrency} clients"):
            before, checks = await http_round(api, dbs, concurrency, warmup, duration, watched)
        tag, reference = f"bench-{uuid.uuid4().hex[:8]}", f"bench-batch-{uuid.uuid4().hex[:8]}"
        with console.status(f"batch round: {rows:,} rows uploaded, waiting for batch.completed"):
            file = payroll(rows, tag)
            cpu = cpu_seconds(watched)
            timing = await upload_and_wait(api, dbs, file, reference, timeout=max(600.0, rows / 5))
            timing["cpu_ms_per_row"] = per_payment_ms(cpu, cpu_seconds(watched), rows)
            checks += await batch_checks(dbs, timing["batch_id"], rows, tag, reference)
        with console.status(f"batch round: HTTP new payments after, {duration:g} s"):
            after, more = await http_round(api, dbs, concurrency, warmup, duration, watched)
            checks += more
        with console.status(f"batch round: another {rows:,} rows and HTTP new payments at the same moments"):
            together, more = await side_by_side(api, dbs, rows, concurrency, warmup, watched)
            checks += more
    http_rate = (before["per_second"] + after["per_second"]) / 2
    rows_per_second = rows / timing["accepted_to_completed_s"]
    return {
        "rows": rows, "concurrency": concurrency, "consumers": consumers, "api_workers": 1,
        "http_before": before, "http_after": after, "http_per_second": round(http_rate, 1),
        "rows_per_second": round(rows_per_second, 1),
        "paying_rows_per_second": round(rows / timing["paying_s"], 1) if timing["paying_s"] else None,
        # One after the other: drift between the runs moves it (reported, not judged).
        "ratio_one_after_the_other": round(rows_per_second / http_rate, 3) if http_rate else None,
        **timing,
        "side_by_side": together,
        "target": report.target("batch", together["ratio"]),
        "exactly_once": {"pass": all(c.ok for c in checks),
                         "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks]},
    }


def passed(figures: dict[str, Any] | None) -> bool:
    return not figures or figures["exactly_once"]["pass"]


def print_round(figures: dict[str, Any] | None) -> None:
    if not figures:
        return
    from rich.table import Table

    t = figures["target"]
    table = Table(title=f"the batch round: {figures['rows']:,} rows over the broker beside HTTP new payments "
                        f"(one API process, {figures['consumers']} consumer process(es), {figures['concurrency']} "
                        f"in flight each)", title_justify="left")
    for column in ("figure", "value"):
        table.add_column(column)
    table.add_row("HTTP new payments/s: before, after (mean)",
                  f"{figures['http_before']['per_second']:.1f}, {figures['http_after']['per_second']:.1f} "
                  f"({figures['http_per_second']:.1f})")
    table.add_row("the upload (POST to 202)", f"{figures['upload_s']:.2f} s")
    table.add_row("upload to batch.completed", f"{figures['upload_to_completed_s']:.1f} s")
    table.add_row("batch rows/s (202 to batch.completed)", f"{figures['rows_per_second']:.1f}")
    table.add_row("batch rows/s while paying (first payment to last, database clock)",
                  report.fmt(figures["paying_rows_per_second"], 1))
    table.add_row("rows/s ÷ HTTP payments/s, one after the other (not judged: drift)",
                  report.fmt(figures["ratio_one_after_the_other"], 3))
    sbs = figures["side_by_side"]
    table.add_row("at the same moments: batch rows/s, HTTP new payments/s",
                  f"{sbs['rows_per_second']:.1f}, {sbs['http_per_second']:.1f} "
                  f"(upload to batch.completed {sbs['upload_to_completed_s']:.1f} s)")
    colour = "green" if t["met"] else "red" if t["met"] is False else "yellow"
    table.add_row(f"{t['target']} ({t['goal']})", f"{report.fmt(t['value'], 3)} [{colour}]{t['verdict']}[/]")
    http_cpu = figures["http_before"].get("cpu_ms_per_payment", {})
    for name, ms in figures.get("cpu_ms_per_row", {}).items():
        table.add_row(f"CPU ms per payment: {name}, HTTP (before) -> batch row",
                      f"{report.fmt(http_cpu.get(name), 2)} -> {report.fmt(ms, 2)}")
    table.add_row("exactly-once (the batch's rows and both HTTP runs)",
                  "ok" if figures["exactly_once"]["pass"] else "[red]FAILED[/]: " + "; ".join(
                      f"{c['check']}: {c['detail']}" for c in figures["exactly_once"]["checks"] if not c["ok"]))
    console.print(table)


async def side_by_side(api: Service, dbs: Databases, rows: int, concurrency: int, warmup: float,
                       watched: dict[str, list[psutil.Process]]) -> tuple[dict[str, Any], list[Check]]:
    """A second file paid while HTTP clients pay new payments, at the same moments: the judged ratio.

    HTTP runs in slices of SLICE_SECONDS from before the upload until the
    batch has completed; its rate is its payments over its slices' time,
    the batch's its rows over the time from its 202 to its event. Whatever
    else the machine does then slows both alike.
    """
    tag, reference = f"bench-{uuid.uuid4().hex[:8]}", f"bench-batch-{uuid.uuid4().hex[:8]}"
    file = payroll(rows, tag)
    results = []
    async with Load(api.url, dbs.api_key, concurrency) as load:
        await load.new_payments(warmup)
        done = asyncio.Event()

        async def http() -> None:
            while not done.is_set():
                results.append(await load.new_payments(SLICE_SECONDS))

        cpu = cpu_seconds(watched)
        clients = asyncio.create_task(http())
        try:
            timing = await upload_and_wait(api, dbs, file, reference, timeout=max(600.0, rows / 5))
        finally:
            done.set()
            await clients
        spent = cpu_seconds(watched)
    paid = sum(r.succeeded for r in results)
    http_rate = paid / sum(r.elapsed for r in results)
    rows_per_second = rows / timing["accepted_to_completed_s"]
    checks = await batch_checks(dbs, timing["batch_id"], rows, tag, reference)
    for result in results:
        checks += await exactly_once(PHASED, dbs.service_url, dbs.rails_url, dbs.client_id, result)
    return {**timing, "http_payments": paid, "http_per_second": round(http_rate, 1),
            "rows_per_second": round(rows_per_second, 1),
            "ratio": round(rows_per_second / http_rate, 3) if http_rate else None,
            "cpu_ms_per_payment_and_row": per_payment_ms(cpu, spent, paid + rows)}, checks


def main(
    rows: int = typer.Option(ROWS, min=1, max=ROWS, help="Rows in the batch."),
    concurrency: int = typer.Option(32, min=1, help="HTTP clients, and rows the consumers pay at once."),
    duration: float = typer.Option(20.0, min=1, help="Seconds of each measured HTTP run (before and after)."),
    warmup: float = typer.Option(3.0, min=0, help="Seconds of warm-up before each HTTP run (not counted)."),
    consumers: int = typer.Option(1, min=1, help="`payments consume` processes, sharing --concurrency."),
) -> None:
    """Only the batch round of `make bench`, on databases of its own: rows/s beside HTTP payments/s."""
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        with running([psp, rail]):
            figures = asyncio.run(measure(dbs, psp, rail, rows=rows, concurrency=concurrency, duration=duration,
                                          warmup=warmup, consumers=consumers))
    print_round(figures)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench-batch-{started}.json"
    path.write_text(json.dumps({"timestamp": started, "batches": figures}, indent=2, default=str) + "\n")
    console.print(f"results: {path}")
    if not passed(figures):
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
