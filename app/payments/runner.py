"""drive(operation): resume from the recorded recovery point to the end.

The API (for a new request or a client retry that took over) and, in a later
issue, the recovery worker all call this one function, so there is exactly
one way a payment moves forward. Between phases it makes the external call
that the recovery point names, with no transaction or pooled connection held.

At a SENT point it knows only that the call *may* have been made. A fresh
owner that just recorded the intent sends at once; a resumed owner probes
first and sends (with the same derived key) only if the external system has
no record. If the outcome stays unknown after one inline probe, it releases
the operation at the same recovery point and reports it pending: unknown is
never reported as failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.db.transaction import atomic
from app.payments import phases
from app.payments.phases import Operation
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, FINISHED
from app.rails.client import PSP, Rail
from app.rails.outcomes import Applied, CallOutcome, ProbeOutcome, Unknown


@dataclass(frozen=True)
class Services:
    """What the runner needs; built once per process in `create_app`."""

    settings: Settings
    engine: AsyncEngine
    psp: PSP
    rail: Rail


@dataclass(frozen=True)
class Finished:
    status_code: int
    body: str


@dataclass(frozen=True)
class Pending:
    """The operation is released at a SENT point whose outcome is unknown."""

    operation: Operation
    reason: str


@dataclass(frozen=True)
class _Step:
    send: Callable[[Services, Operation], Awaitable[CallOutcome]]
    probe: Callable[[Services, Operation], Awaitable[ProbeOutcome]]
    record: Callable[..., Awaitable[Operation]]


_STEPS = {
    EXT1_SENT: _Step(
        send=lambda s, op: s.psp.charge(op.payment.psp_charge_key, op.payment),
        probe=lambda s, op: s.psp.find_charge(op.payment.psp_charge_key),
        record=phases.record_charge,
    ),
    EXT2_SENT: _Step(
        send=lambda s, op: s.rail.transfer(op.payment.rail_transfer_key, op.payment),
        probe=lambda s, op: s.rail.find_transfer(op.payment.end_to_end_reference),
        record=phases.record_transfer,
    ),
    EXT3_SENT: _Step(
        send=lambda s, op: s.psp.refund(op.payment.psp_refund_key, op.payment),
        probe=lambda s, op: s.psp.find_refund(op.payment.psp_refund_key),
        record=phases.record_refund,
    ),
}


async def drive(services: Services, op: Operation) -> Finished | Pending:
    """Run the remaining steps of `op`; raises LeaseLost if it is taken over meanwhile."""
    while op.recovery_point != FINISHED:
        step = _STEPS[op.recovery_point]
        outcome = await _call(services, step, op)
        if isinstance(outcome, Unknown):
            await atomic(services.engine, phases.release, op, outcome.reason)
            return Pending(op, outcome.reason)
        op = await atomic(services.engine, step.record, op, outcome.record, services.settings.lease_seconds)
    assert op.response is not None
    return Finished(*op.response)


async def _call(services: Services, step: _Step, op: Operation) -> CallOutcome:
    if op.resumed:
        # A dead or timed-out attempt may have sent this call already: only a
        # definite NotFound lets us send (and even then with the same key).
        found = await step.probe(services, op)
        if isinstance(found, (Applied, Unknown)):
            return found
    sent = await step.send(services, op)
    if isinstance(sent, Unknown):
        # One cheap probe is worth trying inline: a timed-out call that was
        # applied is then recorded now instead of by the next actor.
        found = await step.probe(services, op)
        if isinstance(found, Applied):
            return found
    return sent
