"""The payment, as a state machine: read this first, top to bottom.

A payment is a card charge at the PSP, then a payout of the net amount over
the rail. Each recovery point below is a fact already durable; at each SENT
point the engine (app/machine/engine.py) makes the named call with no
transaction open, then commits its outcome in the named phase
(app/payments/phases.py, each beside its statement), which leaves the next
recovery point. A resumed owner probes first, and sends (with the same
derived key) only what the external system has never seen.

    start       Handler1: claim the key, create the payment    -> EXT1_SENT
    EXT1_SENT   charge the card with K1      record_charge     -> EXT2_SENT | finished (declined)
    EXT2_SENT   send the payout with K2      record_transfer   -> finished (succeeded) | EXT3_SENT (rejected)
    EXT3_SENT   refund the charge with K3    record_refund     -> finished (failed)

Parked (attempts exhausted, or a legacy payout unknown), the payment is
`indeterminate` until the worker's re-probe or reconciliation against the
rail's statement settles it.
"""

from __future__ import annotations

from app.machine.declare import FINISHED, Call, Machine, Start
from app.payments import phases
from app.payments.models import Payment
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT

PAYMENT: Machine[Payment] = Machine(
    name="payment",
    endpoint="POST /v1/payments",
    start=Start(phases.handler1, "Handler1: claim the key, create the payment with its fee and K1", leads_to=EXT1_SENT),
    calls={
        EXT1_SENT: Call(
            "EXT1", "charge the card at the PSP with K1",
            send=lambda s, p: s.psp.charge(p.psp_charge_key, p),
            probe=lambda s, p: s.psp.find_charge(p.psp_charge_key),
            record=phases.record_charge, leads_to=(EXT2_SENT, FINISHED),
        ),
        EXT2_SENT: Call(
            "EXT2", "send the payout over the rail with K2 and its end-to-end reference",
            send=lambda s, p: s.rail.transfer(p.rail_transfer_key, p),
            probe=lambda s, p: s.rail.find_transfer(p.end_to_end_reference),
            record=phases.record_transfer, leads_to=(FINISHED, EXT3_SENT),
            # A legacy rail neither deduplicates nor answers probes: its payout
            # is sent at most once, and an unknown outcome is settled from its
            # daily statement (app/workers/reconciliation.py).
            repeatable=lambda s, p: s.rail.deduplicates(p),
            settled_by="the rail's daily statement",
        ),
        EXT3_SENT: Call(
            "EXT3", "refund the charge at the PSP with K3 (the rail rejected the payout)",
            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.amount_minor),
            probe=lambda s, p: s.psp.find_refund(p.psp_refund_key),
            record=phases.record_refund, leads_to=(FINISHED,),
        ),
    },
    load=phases.load,
    on_park=phases.indeterminate,
    on_unpark=phases.reopened,
    log_fields=phases.log_fields,
)
