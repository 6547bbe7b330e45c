"""A client's refund of a payment, as a state machine: read this first, top to bottom.

The second operation a client starts, declared on the same engine as the
payment (app/machine/engine.py), under its own Idempotency-Key: each
recovery point below is a fact already durable; at the SENT point the engine
makes the call with no transaction open, then commits its outcome in the
named phase (app/payments/refunds/phases.py, each beside its statement).

    start       claim the key, reserve the amount on the payment   -> EXT5_SENT | finished (refused)
    EXT5_SENT   refund the card with K5      record_outcome         -> finished (succeeded | failed)

A PSP that takes the refund as `pending` is polled: each poll an attempt,
with the engine's backoff, never a second send. Still pending after the last
attempt, the refund is parked (the client hears `refund.pending`) and the
PSP's daily settlement report settles it (app/workers/refund_settlement.py).
"""

from __future__ import annotations

from app.machine.declare import FINISHED, Call, Machine, Start
from app.observability import metrics
from app.payments.recovery_points import EXT5_SENT
from app.payments.refunds import phases
from app.payments.refunds.models import Refund

REFUND: Machine[Refund] = Machine(
    name="refund",
    endpoint="POST /v1/payments/{id}/refunds",
    start=Start(
        phases.claim_refund, "claim the key, reserve the refund's amount on the payment, create the refund with K5",
        leads_to=(EXT5_SENT, FINISHED), transaction=True,
    ),
    calls={
        EXT5_SENT: Call(
            "EXT5", "refund the card at the PSP with K5",
            send=lambda s, r: s.psp.client_refund(r.psp_refund_key, r),
            probe=lambda s, r: s.psp.find_client_refund(r.psp_refund_key),
            record=phases.record_outcome, leads_to=(FINISHED,),
            settled_by="the PSP's daily settlement report",
        ),
    },
    load=phases.load,
    on_park=phases.still_pending,
    log_fields=phases.log_fields,
    started=metrics.REFUNDS_STARTED,
    finished=metrics.REFUNDS_FINISHED,
)
