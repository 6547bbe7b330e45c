"""Does the key's form alone make the fake PSP work more? Not the payment path, a measurement.

The safe service sends the PSP a key derived from the client's (64
hexadecimal characters, app/idempotency/keys.py::derived_key); the naive
twin sends a fresh UUID (36). The fakes keep the key in two indexed text
columns, where a longer key can cost more in every comparison. The rate at
once (bench/rate_at_once.py) found the fakes spending more a payment for the
safe service's calls; this measures how much of that the key's form can be.

Two fake PSPs run at once under the same load, `--clients` each, charging
directly (no service in between). In each round one gets 64-hex keys and
the other UUIDs, and the forms swap every round, so a difference between
the two processes cancels. Per charge: each fake's CPU and its database
sessions' (bench/sessions.py), and the hex ÷ uuid ratio of their sum; the
median of the rounds' ratios is the figure.

    EMBEDDED_PG_PORT=25981 PAYMENTS_DATA_DIR=/tmp/kl-data .venv/bin/python -m bench.fake_keys

It runs on the embedded PostgreSQL of EMBEDDED_PG_PORT / PAYMENTS_DATA_DIR
(or DATABASE_URL's server), in a database of its own, `payments_fake_keys`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import asyncpg
import typer

from bench.sessions import Mark, Meter
from bench.system import Service, console, database_server, fakes, running

DATABASE = "payments_fake_keys"
FORMS: dict[str, Callable[[], str]] = {
    "hex": lambda: hashlib.sha256(os.urandom(16)).hexdigest(),  # the derived key's form
    "uuid": lambda: str(uuid.uuid4()),  # the twin's
}


def forms_of(round_: int) -> dict[str, str]:
    """Which fake gets which key form in round `round_` (from 0): swapped every round."""
    return {"A": "hex", "B": "uuid"} if round_ % 2 == 0 else {"A": "uuid", "B": "hex"}


def round_figures(before: Mark, after: Mark, forms: dict[str, str], charges: dict[str, int]) -> dict[str, Any]:
    """CPU ms a charge by key form (the fake's process and its sessions), its wake-ups a charge, and hex ÷ uuid."""
    figures: dict[str, Any] = {}
    for fake, form in forms.items():
        process, sessions = Meter.spent(before, after, fake)
        n = max(1, charges[fake])
        figures[form] = {"charges": charges[fake], "process_ms": 1000 * process / n, "sessions_ms": 1000 * sessions / n,
                         "woken": Meter.woken(before, after, fake) / n}
    hex_, uuid_ = (figures[f]["process_ms"] + figures[f]["sessions_ms"] for f in ("hex", "uuid"))
    figures["ratio"] = hex_ / uuid_ if uuid_ else None
    return figures


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of the rounds' hex ÷ uuid ratios, and their lowest and highest."""
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    return {"rounds": rounds, "ratio": statistics.median(ratios) if ratios else None,
            "lowest": min(ratios, default=None), "highest": max(ratios, default=None)}


async def _charge_until(session: aiohttp.ClientSession, url: str, key: Callable[[], str], stop: float) -> int:
    charged = 0
    while time.monotonic() < stop:
        body = {"amount": 1000, "currency": "EUR", "card_token": "tok_visa", "reference": uuid.uuid4().hex,
                "description": f"payment {uuid.uuid4()}"}
        async with session.post(f"{url}/v1/charges", json=body, headers={"Idempotency-Key": key()}) as response:
            await response.read()
            if response.status not in (200, 201):
                raise RuntimeError(f"the fake PSP answered {response.status}")
        charged += 1
    return charged


async def _rounds(server_url: str, psps: dict[str, Service], count: int, seconds: float, clients: int
                  ) -> dict[str, Any]:
    conn = await asyncpg.connect(server_url)
    meter = Meter(conn, server_url, psps)
    rounds = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def each(forms: dict[str, str], duration: float) -> dict[str, int]:
                stop = time.monotonic() + duration
                counts = await asyncio.gather(*(
                    asyncio.gather(*(_charge_until(session, psps[fake].url, FORMS[form], stop) for _ in range(clients)))
                    for fake, form in forms.items()))
                return {fake: sum(c) for fake, c in zip(forms, counts)}

            await each(forms_of(0), 2.0)  # warm-up, not counted
            for round_ in range(count):
                forms = forms_of(round_)
                before = await meter.mark()
                charges = await each(forms, seconds)
                figures = round_figures(before, await meter.mark(), forms, charges)
                rounds.append(figures)
                console.print(f"round {round_ + 1}: hex ÷ uuid {figures['ratio']:.3f} (" + "; ".join(
                    f"{form} {figures[form]['process_ms']:.3f} + {figures[form]['sessions_ms']:.3f} ms a charge, "
                    f"{figures[form]['charges']} charges, woken {figures[form]['woken']:.2f} a charge" for form in FORMS
                ) + ")")
    finally:
        await conn.close()
    return summary(rounds)


def main(
    rounds: int = typer.Option(8, help="Rounds; the key forms swap between the two fakes every round."),
    seconds: float = typer.Option(10.0, help="Seconds a round."),
    clients: int = typer.Option(16, help="Concurrent clients for each fake."),
) -> None:
    with database_server() as server:
        rails_url = server.system.create_database(DATABASE, migrate=False)
        psps = {"A": fakes(rails_url, whose="A")[0], "B": fakes(rails_url, whose="B")[0]}
        with running(list(psps.values())):
            result = asyncio.run(_rounds(server.url, psps, rounds, seconds, clients))
    console.print(f"the fake PSP's CPU a charge with a 64-hex key ÷ with a UUID, its sessions' included: median "
                  f"{result['ratio']:.3f} of {rounds} rounds ({result['lowest']:.3f} to {result['highest']:.3f})")


if __name__ == "__main__":
    typer.run(main)
