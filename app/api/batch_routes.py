"""The payment batch routes: a file of rows in, a batch's progress out; no SQL, no transaction.

POST takes the raw file (CSV or JSON lines, by Content-Type) under its own
body cap (BATCH_MAX_BODY_BYTES, app/api/body_limit.py) and its own
Idempotency-Key; app/payments/batches/submission.py decides the rest.
docs/batches.md walks through a batch from upload to `batch.completed`.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import ClientId, PaymentCallerDep, ServicesDep
from app.api.errors import problem_doc
from app.api.routes import final_response, id_in_path
from app.machine.engine import Finished
from app.payments.batches import submission
from app.payments.batches.rows import CSV_COLUMNS, MAX_BATCH_BYTES, MAX_ROWS
from app.problems import INVALID_REQUEST, NOT_FOUND, ProblemError

router = APIRouter()
PATH = "/v1/payment-batches"
BATCH_MAX_BODY_BYTES = MAX_BATCH_BYTES


@router.post(
    PATH,
    status_code=202,
    summary="Submit a payment batch: every row validated, then each paid exactly once",
    tags=["payment batches"],
    description=(
        f"The body is the file itself: CSV with the header `{','.join(CSV_COLUMNS)}` (`Content-Type: text/csv`), "
        "or JSON lines, one payment object per line with `reference`, `value_date`, `amount`, `currency`, "
        "`card_token` and `beneficiary` (`Content-Type: application/x-ndjson`). At most "
        f"{MAX_ROWS} rows and {MAX_BATCH_BYTES // (1024 * 1024)} MiB. `reference` names the batch. Every row is "
        "checked first: one bad row refuses the whole file (400 invalid-batch, every bad row listed) and nothing "
        "is stored. Each row's Idempotency-Key is derived from the client, the batch reference, the row's "
        "reference and its value date, so the same file sent again, under any key, pays nothing twice "
        "(docs/batches.md). The upload's own `Idempotency-Key` makes the upload safe to retry."
    ),
    # The body is a file, read raw: described here, since no model describes it.
    openapi_extra={"requestBody": {"required": True, "content": {
        "text/csv": {"schema": {"type": "string"}, "example": ",".join(CSV_COLUMNS)
                     + "\nemp-00001,2026-12-24,250000,EUR,tok_visa,Ada Lovelace,DE89370400440532013000\n"},
        "application/x-ndjson": {"schema": {"type": "string"}},
    }}},
    responses={
        202: {"description": "Accepted: the rows are queued for payment. Poll `Location`."},
        400: problem_doc("idempotency-key-missing", "idempotency-key-invalid", "invalid-request", "invalid-batch"),
        401: problem_doc("unauthenticated"),
        413: problem_doc("payload-too-large"),
        422: problem_doc("idempotency-key-reused"),
        503: problem_doc("service-unavailable", "key-table-unavailable"),
    },
)
async def create_batch(
    request: Request, services: ServicesDep, caller: PaymentCallerDep,
    reference: str = Query(..., pattern=r"^[A-Za-z0-9_.:/-]{1,64}$",
                           description="Your identifier for the batch (a payroll run: `payroll-2026-12`)."),
) -> Response:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in submission.MEDIA_TYPES:
        raise ProblemError(INVALID_REQUEST, f"Content-Type must be one of {', '.join(submission.MEDIA_TYPES)}")
    body = await request.body()
    reply = await submission.submit_batch(services, caller.client_id, caller.key, reference, body, media_type,
                                          row=caller.row)
    assert isinstance(reply.outcome, Finished)  # an upload finishes in its one phase
    response = final_response(reply.outcome, replayed=reply.replayed)
    batch_id = _id_of(reply.outcome.body)
    if batch_id:
        response.headers["Location"] = f"{PATH}/{batch_id}"
    return response


def _id_of(body: str) -> str | None:
    try:
        return json.loads(body).get("id")
    except ValueError:
        return None


@router.get(
    PATH + "/{batch_id}",
    summary="A batch's rows counted by state, and its failed rows",
    tags=["payment batches"],
    responses={401: problem_doc("unauthenticated"), 404: problem_doc("not-found")},
)
async def get_batch(services: ServicesDep, client_id: ClientId, batch_id: str) -> Response:
    found = await submission.find_batch(services, client_id, id_in_path(batch_id, "batch"))
    if not found:
        raise ProblemError(NOT_FOUND, "no such batch")
    return Response(json.dumps(found.view()), media_type="application/json")
