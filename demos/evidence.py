"""Reading the durable facts: our key row, payment and ledger, and the fakes' own records.

The fakes' tables are read directly (`fake_psp.charge`, `fake_psp.refund`,
`fake_rail.transfer`): what the PSP and the rail recorded is the ground truth
of how often money moved, whatever our own tables say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from demos.system import System


@dataclass
class Snapshot:
    key: asyncpg.Record | None
    lease_left: float | None  # seconds, by the database clock; None: no lease
    payments: list[asyncpg.Record]
    charges: list[asyncpg.Record]
    refunds: list[asyncpg.Record]
    transfers: list[asyncpg.Record]
    ledger: list[asyncpg.Record]

    @property
    def payment(self) -> asyncpg.Record | None:
        return self.payments[0] if len(self.payments) == 1 else None

    @property
    def debits(self) -> int:
        return sum(e["debit_minor"] for e in self.ledger)

    @property
    def credits(self) -> int:
        return sum(e["credit_minor"] for e in self.ledger)

    @property
    def balanced(self) -> bool:
        """Every payment's entries balance: sum of debits = sum of credits, per payment."""
        per_payment: dict[Any, int] = {}
        for e in self.ledger:
            per_payment[e["payment_id"]] = per_payment.get(e["payment_id"], 0) + e["debit_minor"] - e["credit_minor"]
        return all(v == 0 for v in per_payment.values())

    @property
    def timeline(self) -> list[dict[str, Any]]:
        if self.key is None:
            return []
        raw = self.key["timeline"]
        return json.loads(raw) if isinstance(raw, str) else list(raw)


def snapshot(system: System, key: str | None, reference: str) -> Snapshot:
    db = system.db
    row = db.fetchrow(
        "SELECT *, extract(epoch FROM lease_expires_at - now())::float8 AS lease_left "
        "FROM idempotency_key WHERE client_id = $1 AND key = $2", system.client_id, key,
    ) if key else None
    payments = db.fetch("SELECT * FROM payment WHERE client_id = $1 AND reference = $2 ORDER BY created_at",
                        system.client_id, reference)
    ledger = db.fetch(
        "SELECT payment_id, posting, account, debit_minor, credit_minor FROM ledger_entry "
        "WHERE payment_id = ANY($1::uuid[]) ORDER BY id", [p["id"] for p in payments],
    )
    return Snapshot(
        key=row,
        lease_left=row["lease_left"] if row else None,
        payments=payments,
        charges=db.fetch("SELECT * FROM fake_psp.charge WHERE reference = $1 ORDER BY created_at", reference),
        refunds=db.fetch("SELECT * FROM fake_psp.refund WHERE reference = $1 ORDER BY created_at", reference),
        transfers=db.fetch("SELECT * FROM fake_rail.transfer WHERE reference = $1 ORDER BY created_at", reference),
        ledger=ledger,
    )


def relative_times(entries: list[dict[str, Any]]) -> list[str]:
    """`+0.123 s` from the first entry, for reading a timeline at a glance."""
    if not entries:
        return []
    t0 = datetime.fromisoformat(entries[0]["at"])
    return [f"+{(datetime.fromisoformat(e['at']) - t0).total_seconds():.3f} s" for e in entries]
