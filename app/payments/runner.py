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

Every way a step can end without an applied answer is handled the same way
(`_give_up`): an unknown outcome, a call certainly not applied (a refused
connection), and an exception (a bug, a lost database connection) each count
as an attempt; the operation is released at the same recovery point, to be
retried after a backoff with jitter, or parked after `max_attempts`. Nothing
retries at once and nothing ignores the limit, so no fault can make a
payment loop. Either way the caller hears "pending": unknown is never
reported as failed.

A parked operation is not forgotten: where the external system answers
probes, the worker asks it again every `parked_recheck_seconds` (`heal`)
and drives the payment on once it answers.

What operators see (docs/operations.md): every step rebinds the payment's
log fields (`_bind`), so each line carries the client, the payment, the
key's hash, the recovery point, the attempt and the lease token; a finished
payment is one INFO line and one count by status, and every takeover,
release and park is counted by recovery point and logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.db.errors import describe, loggable
from app.db.transaction import atomic, one_statement, read
from app.idempotency import store as keys
from app.idempotency.store import LeaseLost
from app.observability import logs, metrics
from app.payments import crash_points, phases
from app.payments import store as payments
from app.payments.models import Payment
from app.payments.phases import Operation
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT4_SENT, FINISHED
from app.rails.outcomes import Applied, CallOutcome, NotApplied, ProbeOutcome, Unknown, outcome_class
from app.services import Services

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    status_code: int
    body: str


@dataclass(frozen=True)
class Pending:
    """The operation is released (or parked) at a SENT point whose outcome is not known yet."""

    payment: Payment
    reason: str


@dataclass(frozen=True)
class _Step:
    send: Callable[[Services, Payment], Awaitable[CallOutcome]]
    probe: Callable[[Services, Payment], Awaitable[ProbeOutcome]]
    record: Callable[..., Awaitable[Operation]]
    # Whether the external system deduplicates this call by its key and
    # answers probes, so that probing and re-sending are safe.
    repeatable: Callable[[Services, Payment], bool] = lambda s, p: True


_STEPS = {
    EXT1_SENT: _Step(
        send=lambda s, p: s.psp.charge(p.psp_charge_key, p),
        probe=lambda s, p: s.psp.find_charge(p.psp_charge_key),
        record=phases.record_charge,
    ),
    EXT2_SENT: _Step(
        send=lambda s, p: s.rail.transfer(p.rail_transfer_key, p),
        probe=lambda s, p: s.rail.find_transfer(p.end_to_end_reference),
        record=phases.record_transfer,
        repeatable=lambda s, p: s.rail.deduplicates(p),
    ),
    EXT3_SENT: _Step(
        send=lambda s, p: s.psp.refund(p.psp_refund_key, p),
        probe=lambda s, p: s.psp.find_refund(p.psp_refund_key),
        record=phases.record_refund,
    ),
    # The compensation of a returned payout (app/payments/returns.py): the
    # same refund, under its own derived key K4.
    EXT4_SENT: _Step(
        send=lambda s, p: s.psp.refund(p.psp_refund_key, p),
        probe=lambda s, p: s.psp.find_refund(p.psp_refund_key),
        record=phases.record_return_refund,
    ),
}


async def drive(services: Services, op: Operation) -> Finished | Pending:
    """Run the remaining steps of `op`; raises LeaseLost if it is taken over meanwhile.

    Anything that stops a step short (an outcome that is not applied, or an
    exception) is handed to `_give_up`. Only two things leave here as
    exceptions: LeaseLost, and a database that cannot even record the give-up
    (then the lease simply runs out and the next actor resumes). If the task
    is cancelled (a worker or an API process shutting down), the lease is
    given back at once, so that the next actor need not wait for it to run out.
    """
    while op.recovery_point != FINISHED:
        _bind(op)
        cause = None  # counted by the outcome's class, unless the step raised
        try:
            result = await _step(services, op)
        except LeaseLost:
            raise
        except Exception as exc:
            # A bug, or the database lost between the call and its record.
            # Whatever the call did, the recovery point still says it may
            # have been made, so the next attempt probes: handled exactly as
            # an unknown outcome.
            log.error("driving the payment at %s was interrupted\n%s", op.recovery_point, loggable(exc))
            result, cause = Unknown(f"interrupted by {type(exc).__name__}"), "error"
        except BaseException:
            await asyncio.shield(_release_now(services, op))
            raise
        if isinstance(result, Operation):
            op = result
            if op.recovery_point == FINISHED:
                report_finished(op)
            continue
        final = isinstance(result, Unknown) and not _STEPS[op.recovery_point].repeatable(services, op.payment)
        return await _give_up(services, op, result, final=final, cause=cause)
    assert op.response is not None
    return Finished(*op.response)


def _bind(op: Operation) -> None:
    """The payment's fields on every line this task logs from here on (app/observability/logs.py)."""
    logs.bind(
        client_id=op.lease.client_id, key_hash=logs.key_hash(op.lease.key), payment_id=str(op.payment.id),
        recovery_point=op.recovery_point, attempt=op.attempt, lease_token=str(op.lease.token),
    )


def report_finished(op: Operation) -> None:
    """A payment reached its final status here: counted once, by status, and logged at INFO.

    Called right after the phase that finished it committed (by `drive`, or
    by reconciliation when a statement settles a payout), so a payment is
    counted by the one process whose commit finished it.
    """
    _bind(op)
    metrics.child(metrics.FINISHED, op.payment.status).inc()
    log.info("payment finished: %s", op.payment.status)


async def _step(services: Services, op: Operation) -> Operation | NotApplied | Unknown:
    """Make the call this recovery point names and record its outcome: the next operation, or why not."""
    crash_at = services.settings.payments_crash_at
    step = _STEPS[op.recovery_point]
    if step.repeatable(services, op.payment):
        outcome = await _call(services, step, op)
    else:
        outcome = await _call_once(services, step, op)
    if not isinstance(outcome, Applied):
        return outcome
    crash_points.reached(crash_at, f"after-call-{crash_points.CALL_OF[op.recovery_point]}")
    op = await one_statement(services.engine, step.record, op, outcome.record, services.settings.lease_seconds)
    log.debug("committed %s", op.recovery_point)
    crash_points.reached(crash_at, f"after-commit-{op.recovery_point}")
    return op


async def _give_up(
    services: Services, op: Operation, outcome: NotApplied | Unknown, *, final: bool, cause: str | None = None
) -> Pending:
    """Release the operation for a later attempt, or park it after the last one.

    `final` parks at once: no later attempt could learn more (a legacy rail
    can neither be probed nor safely sent the transfer again). A call that
    was certainly not applied is never final: it is safe to send later.
    `cause` is what metrics count it by: the outcome's class (unknown,
    not_applied), or error when a step raised.
    """
    settings = services.settings
    cause = cause or outcome_class(outcome)
    not_sent = isinstance(outcome, NotApplied)
    if final or op.attempt >= settings.max_attempts:
        payment = await atomic(
            services.engine, phases.park, op, outcome.reason, settings.parked_recheck_seconds, not_sent=not_sent
        )
        metrics.child(metrics.PARKS, op.recovery_point, cause).inc()
        log.warning("parked as indeterminate after attempt %s: %s", op.attempt, outcome.reason)
        return Pending(payment, outcome.reason)
    retry_in = backoff_seconds(op.attempt, settings.backoff_base_seconds, settings.backoff_cap_seconds)
    await one_statement(services.engine, phases.release, op, outcome.reason, retry_in, not_sent=not_sent)
    metrics.child(metrics.RELEASES, op.recovery_point, cause).inc()
    log.info("released: %s; the worker retries in %.1f s", outcome.reason, retry_in)
    return Pending(op.payment, outcome.reason)


async def _release_now(services: Services, op: Operation) -> None:
    """Give the lease back without waiting: the process is stopping, nothing failed."""
    try:
        await one_statement(services.engine, phases.release, op, "interrupted: stopping", 0.0, event="stopping, released")
    except LeaseLost:
        pass  # finished or taken over meanwhile: nothing of ours to release
    except Exception as exc:
        log.warning("could not release the payment (%s); its lease will simply expire", describe(exc))
    else:
        metrics.child(metrics.RELEASES, op.recovery_point, "stopping").inc()
        log.info("stopping: lease given back")


async def take_over(services: Services, client_id: int, key: str) -> Operation | None:
    """Own an operation whose lease ran out or was released (a client retry, or the worker); None if not ours.

    The one place a takeover is made, counted and logged, whoever makes it.
    """
    op = await atomic(services.engine, phases.take_over, client_id, key, services.settings.lease_seconds)
    if op is not None:
        _bind(op)
        metrics.child(metrics.TAKEOVERS, op.recovery_point).inc()
        log.info("taken over at %s (attempt %s)", op.recovery_point, op.attempt)
    return op


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: about base * 2^(attempt-1), capped.

    The jitter (a random half of the delay) keeps operations that failed
    together, in one outage, from all being retried in the same instant.
    """
    ceiling = min(cap, base * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


async def _call_once(services: Services, step: _Step, op: Operation) -> CallOutcome:
    """A call to a system that cannot deduplicate: at most one send that may have landed, ever.

    A resumed owner cannot tell whether the dead one sent it (there is no
    probe), and sending again could pay twice, so it does not send at all.
    Only a release that said the call was certainly not sent (a refused
    connection) lets the next owner send (`op.resumed` is False then).
    """
    if op.resumed:
        return Unknown("the payout may have been sent and this rail can neither be probed nor deduplicate")
    return await step.send(services, op.payment)


async def _call(services: Services, step: _Step, op: Operation) -> CallOutcome:
    if op.resumed:
        # A dead or timed-out attempt may have sent this call already: only a
        # definite NotFound lets us send (and even then with the same key).
        found = await step.probe(services, op.payment)
        if isinstance(found, (Applied, Unknown)):
            return found
    sent = await step.send(services, op.payment)
    if isinstance(sent, Unknown):
        # One cheap probe is worth trying inline: a timed-out call that was
        # applied is then recorded now instead of by the next actor.
        found = await step.probe(services, op.payment)
        if isinstance(found, Applied):
            return found
    return sent


async def heal(services: Services, client_id: int, key: str) -> Finished | Pending | None:
    """Ask the external system about a parked operation again; drive it on once it answers.

    Made by the worker every `parked_recheck_seconds` per parked operation.
    A re-probe that learns nothing (still Unknown) is not an attempt: the
    row keeps its attempts and its timeline, only its next re-probe time
    moves. A probe that answers (applied, or definitely not found) takes the
    operation back (`phases.unpark`, one timeline entry) and drives it from
    its recovery point as any resumer would: probe, then record what was
    applied, or send again with the same derived key what was not found.
    A payout to a rail that cannot be probed is left to reconciliation.
    None: nothing was learned, or someone else has it.
    """
    settings = services.settings
    logs.bind(client_id=client_id, key_hash=logs.key_hash(key))
    claimed = await one_statement(services.engine, keys.claim_recheck, client_id, key, settings.parked_recheck_seconds)
    if claimed is None:
        return None
    recovery_point, payment_id = claimed
    logs.bind(payment_id=str(payment_id), recovery_point=recovery_point)
    payment = await read(services.engine, payments.get, client_id, payment_id)
    step = _STEPS[recovery_point]
    if payment is None or not step.repeatable(services, payment):
        return None
    if isinstance(await step.probe(services, payment), Unknown):
        return None
    op = await atomic(services.engine, phases.unpark, client_id, key, settings.lease_seconds, event="re-probe answered")
    if op is None:
        return None
    _bind(op)
    metrics.child(metrics.UNPARKS, recovery_point, "reprobe").inc()
    log.info("re-probe of the parked payment at %s answered; resuming", recovery_point)
    return await drive(services, op)
