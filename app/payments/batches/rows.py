"""A batch file's rows: parsed, validated up front, and given their natural keys.

The first thing `POST /v1/payment-batches` (and `payments batches submit`)
does with a file, before anything is stored: every row is checked, and one
bad row refuses the whole file with every bad row listed, so a client never
has half a payroll in flight and the other half to fix. A row that passes
becomes a `PaymentRequest`, exactly what `POST /v1/payments` validates, so
the consumer pays it through the same machine.

The natural key (docs/batches.md#the-natural-key): a row is identified by
what the client's own systems already know about it, its client, the
batch's reference, the row's reference and its value date, so the key
is derived, uuid5(NAMESPACE, ...), never generated. The same file uploaded
again, under any batch key, on any day, yields the same keys: each row is
answered by its first payment (a replay while the key row is kept, a
duplicate refusal by payment reference after it is reaped).
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from dataclasses import dataclass
from datetime import date
from typing import Any

from pydantic import ValidationError

from app.payments.models import PaymentRequest, plain_text

# Fixed for ever: changing it changes every row's key, and a resubmitted
# file would then pay every row a second time.
NAMESPACE = uuid.UUID("6f1c2a8e-5b0d-4f3e-9c1a-2d7e8b9a0c41")
# A payroll file of ten thousand rows is about 2 MB; both bounds are documented (docs/batches.md).
MAX_ROWS = 10_000
MAX_BATCH_BYTES = 4 * 1024 * 1024
PAYMENT_REFERENCE_PREFIX = "batch-row:"
CSV_COLUMNS = ("reference", "value_date", "amount", "currency", "card_token", "beneficiary_name", "beneficiary_iban")


@dataclass(frozen=True)
class BatchRow:
    number: int  # 1 for the first row of data
    key: uuid.UUID  # the natural key: the payment's Idempotency-Key
    reference: str  # the client's reference for the row
    value_date: date
    request: PaymentRequest  # its reference is payment_reference(key)


@dataclass(frozen=True)
class BadRow:
    row: int
    field: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"row": self.row, "field": self.field, "message": self.message}


class BadBatch(ValueError):
    """The file is refused whole: `problems` names every bad row (or the file itself, row 0)."""

    def __init__(self, problems: list[BadRow]) -> None:
        super().__init__(f"{len(problems)} problem(s) in the batch")
        self.problems = problems


def natural_key(client_id: int, batch_reference: str, row_reference: str, value_date: date) -> uuid.UUID:
    """uuid5 over the row's identity: the same row of the same batch is the same key, on any upload."""
    return uuid.uuid5(NAMESPACE, f"{client_id}\x1f{batch_reference}\x1f{row_reference}\x1f{value_date.isoformat()}")


def payment_reference(key: uuid.UUID) -> str:
    """The row's payment reference, from its identity: a second payment of the row is refused by reference."""
    return f"{PAYMENT_REFERENCE_PREFIX}{key}"


def parse(client_id: int, batch_reference: str, body: bytes, media_type: str) -> list[BatchRow]:
    """Every row of the file, validated, with its natural key; BadBatch listing every bad row otherwise."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadBatch([BadRow(0, "file", f"not UTF-8 text: {exc.reason} at byte {exc.start}")]) from None
    if media_type == "text/csv":
        raw, problems = _csv_rows(text)
    else:
        raw, problems = _json_lines(text)
    if not raw and not problems:
        problems.append(BadRow(0, "file", "the file has no rows"))
    if len(raw) > MAX_ROWS:
        raise BadBatch([BadRow(0, "file", f"{len(raw)} rows; a batch has at most {MAX_ROWS}")])
    rows: list[BatchRow] = []
    first_of: dict[uuid.UUID, int] = {}
    for number, fields in raw:
        row = _row(client_id, batch_reference, number, fields, problems)
        if row is None:
            continue
        if row.key in first_of:
            problems.append(BadRow(number, "reference", f"row {first_of[row.key]} has the same reference "
                                   f"{row.reference!r} and value date {row.value_date}: one of them is a mistake"))
            continue
        first_of[row.key] = number
        rows.append(row)
    if problems:
        raise BadBatch(sorted(problems, key=lambda p: p.row))
    return rows


def _csv_rows(text: str) -> tuple[list[tuple[int, dict[str, Any]]], list[BadRow]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        return [], [BadRow(0, "header", f"the header lacks {', '.join(missing)} (columns: {', '.join(CSV_COLUMNS)})")]
    extra = [c for c in reader.fieldnames or () if c not in CSV_COLUMNS]
    if extra:
        return [], [BadRow(0, "header", f"unknown columns {', '.join(extra)} (columns: {', '.join(CSV_COLUMNS)})")]
    rows, problems = [], []
    try:
        for number, line in enumerate(reader, 1):
            if None in line or any(v is None for v in line.values()):
                problems.append(BadRow(number, "row", f"{len(CSV_COLUMNS)} columns expected"))
                continue
            fields: dict[str, Any] = {
                "reference": line["reference"], "value_date": line["value_date"], "amount": line["amount"],
                "currency": line["currency"], "card_token": line["card_token"],
                "beneficiary": {"name": line["beneficiary_name"], "iban": line["beneficiary_iban"]},
            }
            rows.append((number, fields))
    except csv.Error as exc:
        problems.append(BadRow(len(rows) + len(problems) + 1, "row", f"not CSV: {exc}"))
    return rows, problems


def _json_lines(text: str) -> tuple[list[tuple[int, dict[str, Any]]], list[BadRow]]:
    rows, problems = [], []
    number = 0
    for line in text.splitlines():
        if not line.strip():
            continue  # a blank line (a trailing newline, say) is not a row
        number += 1
        try:
            value = json.loads(line)
        except ValueError as exc:
            problems.append(BadRow(number, "row", f"not JSON: {exc}"))
            continue
        if not isinstance(value, dict):
            problems.append(BadRow(number, "row", "each line is one JSON object"))
            continue
        rows.append((number, value))
    return rows, problems


def _row(client_id: int, batch_reference: str, number: int, fields: dict[str, Any],
         problems: list[BadRow]) -> BatchRow | None:
    fields = dict(fields)
    row_reference, raw_date = fields.pop("reference", None), fields.pop("value_date", None)
    bad = len(problems)
    reference = _reference(number, row_reference, problems)
    value_date = _value_date(number, raw_date, problems)
    amount = fields.get("amount")
    if isinstance(amount, str):
        # CSV has no numbers: an amount is digits, in minor units, never "12.50".
        fields["amount"] = int(amount) if amount.isdigit() else amount
    # The payment's reference comes from the row's identity; a placeholder
    # while the identity itself is still being checked.
    key = natural_key(client_id, batch_reference, reference or "", value_date or date.min)
    try:
        request = PaymentRequest.model_validate({**fields, "reference": payment_reference(key)})
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(part) for part in error["loc"]) or "row"
            problems.append(BadRow(number, where, error["msg"].removeprefix("Value error, ")))
        return None
    if len(problems) > bad or reference is None or value_date is None:
        return None
    return BatchRow(number, key, reference, value_date, request)


def _reference(number: int, value: Any, problems: list[BadRow]) -> str | None:
    if not isinstance(value, str):
        problems.append(BadRow(number, "reference", "a row needs its reference (your identifier for it)"))
        return None
    try:
        value = plain_text(value)
    except ValueError as exc:
        problems.append(BadRow(number, "reference", str(exc)))
        return None
    if not (1 <= len(value) <= 64) or not all(c.isascii() and (c.isalnum() or c in "_.:/-") for c in value):
        problems.append(BadRow(number, "reference", "1 to 64 characters from A-Z a-z 0-9 _ . : / -"))
        return None
    return value


def _value_date(number: int, value: Any, problems: list[BadRow]) -> date | None:
    try:
        return date.fromisoformat(value) if isinstance(value, str) and len(value) == 10 else _no_date()
    except ValueError:
        problems.append(BadRow(number, "value_date", "a date, YYYY-MM-DD"))
        return None


def _no_date() -> date:
    raise ValueError("not a date")
