"""drive(operation): resume from the recorded recovery point to the end.

The API (for a new request, or a client retry that took over) and the
recovery worker (`app.workers.recovery`) all call this one function, so there
is exactly one way a payment moves forward. Between phases it makes the external call
that the recovery point names, with no transaction or pooled connection held.

At a SENT point it knows only that the call *may* have been made. A fresh
owner that just recorded the intent sends at once; a resumed owner probes
first and sends (with the same derived key) only if the external system has
no record. A rail that cannot deduplicate (a legacy rail) is never probed
and never sent a payout twice: a resumed owner does not send at all, and its
first unknown outcome parks the payment for reconciliation.

If the outcome stays unknown after one inline probe, it releases
the operation at the same recovery point (the worker retries it later, with
backoff) or, after `max_attempts`, parks it as indeterminate for
reconciliation; either way it reports it pending: unknown is never reported
as failed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.db.transaction import atomic, one_statement
from app.payments import crash_points, phases
from app.payments.models import Payment
from app.payments.phases import Operation
from app.idempotency.store import LeaseLost
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, FINISHED
from app.services import Services
from app.rails.outcomes import Applied, CallOutcome, ProbeOutcome, Unknown

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    status_code: int
    body: str


@dataclass(frozen=True)
class Pending:
    """The operation is released (or parked) at a SENT point whose outcome is unknown."""

    payment: Payment
    reason: str


@dataclass(frozen=True)
class _Step:
    send: Callable[[Services, Operation], Awaitable[CallOutcome]]
    probe: Callable[[Services, Operation], Awaitable[ProbeOutcome]]
    record: Callable[..., Awaitable[Operation]]
    # Whether the external system deduplicates this call by its key and
    # answers probes, so that probing and re-sending are safe.
    repeatable: Callable[[Services, Operation], bool] = lambda s, op: True


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
        repeatable=lambda s, op: s.rail.deduplicates(op.payment),
    ),
    EXT3_SENT: _Step(
        send=lambda s, op: s.psp.refund(op.payment.psp_refund_key, op.payment),
        probe=lambda s, op: s.psp.find_refund(op.payment.psp_refund_key),
        record=phases.record_refund,
    ),
}


async def drive(services: Services, op: Operation) -> Finished | Pending:
    """Run the remaining steps of `op`; raises LeaseLost if it is taken over meanwhile.

    If anything else interrupts it (a bug, a lost database, the task being
    cancelled because the worker is shutting down), the lease is given back
    before the exception travels on, so the next actor can resume at once
    instead of waiting for the lease to run out.
    """
    try:
        return await _drive(services, op)
    except LeaseLost:
        raise
    except BaseException as exc:
        await asyncio.shield(_release_after_error(services, op, exc))
        raise


async def _release_after_error(services: Services, op: Operation, exc: BaseException) -> None:
    try:
        await atomic(
            services.engine, phases.release, op, f"interrupted: {exc!r}"[:500], 0.0, event="interrupted, released"
        )
    except LeaseLost:
        pass  # finished or taken over meanwhile: nothing of ours to release
    except Exception:
        log.exception("could not release %r; its lease will simply expire", op.lease.key)


async def _drive(services: Services, op: Operation) -> Finished | Pending:
    crash_at = services.settings.payments_crash_at
    while op.recovery_point != FINISHED:
        step = _STEPS[op.recovery_point]
        repeatable = step.repeatable(services, op)
        outcome = await _call(services, step, op) if repeatable else await _call_once(services, step, op)
        if isinstance(outcome, Unknown):
            return await _give_up(services, op, outcome.reason, final=not repeatable)
        crash_points.reached(crash_at, f"after-call-{crash_points.CALL_OF[op.recovery_point]}")
        op = await one_statement(services.engine, step.record, op, outcome.record, services.settings.lease_seconds)
        crash_points.reached(crash_at, f"after-commit-{op.recovery_point}")
    assert op.response is not None
    return Finished(*op.response)


async def _give_up(services: Services, op: Operation, reason: str, *, final: bool = False) -> Pending:
    """Release the operation for a later attempt, or park it after the last one.

    `final` parks at once: no later attempt could learn more (a legacy rail
    can neither be probed nor safely sent the transfer again).
    """
    settings = services.settings
    if final or op.attempt >= settings.max_attempts:
        payment = await atomic(services.engine, phases.park, op, reason)
        return Pending(payment, reason)
    retry_in = backoff_seconds(op.attempt, settings.backoff_base_seconds, settings.backoff_cap_seconds)
    await one_statement(services.engine, phases.release, op, reason, retry_in)
    return Pending(op.payment, reason)


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: about base * 2^(attempt-1), capped.

    The jitter (a random half of the delay) keeps operations that failed
    together, in one outage, from all being retried in the same instant.
    """
    ceiling = min(cap, base * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


async def _call_once(services: Services, step: _Step, op: Operation) -> CallOutcome:
    """A call to a system that cannot deduplicate: at most one send, ever.

    A resumed owner cannot tell whether the dead one sent it (there is no
    probe), and sending again could pay twice, so it does not send at all.
    """
    if op.resumed:
        return Unknown("the transfer may have been sent and this rail can neither be probed nor deduplicate")
    return await step.send(services, op)


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
