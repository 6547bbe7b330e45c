"""The rules every operation is driven by, written once: claim, drive, give up, take over, heal, settle.

Beneath each operation's declaration (app/machine/declare.py). A client's
request (through app/machine/matrix.py), the recovery worker and
reconciliation all move an operation forward through these functions, so
there is exactly one way it happens:

    drive         from the recorded recovery point to the end: at each SENT
                  point make the declared call with no transaction or pooled
                  connection held, then commit its outcome in the declared
                  record phase
    give up       an outcome that is not applied (unknown, settling, certainly
                  not sent) or an exception: count an attempt, release with
                  backoff, or park after the last attempt
    take over     own an operation whose lease ran out or was released
    heal          re-probe a parked operation; drive it on once it answers
    settle_parked reconciliation's answer for a parked call, recorded as its
                  record phase would have recorded the call's own answer

Every phase commits together with the key row's change, fenced by the lease
token: a stalled owner whose lease was taken over writes nothing and gets
`LeaseLost`. Unknown is never reported as failed: the caller hears "pending".
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.errors import describe, loggable
from app.db.transaction import atomic, one_statement, read
from app.idempotency import key_table
from app.idempotency.key_table import Lease, LeaseLost
from app.machine.crash import reached
from app.machine.declare import FINISHED, Call, Machine, Operation
from app.machine.statements import Statement
from app.observability import logs, metrics
from app.rails.outcomes import Applied, CallOutcome, NotApplied, Settling, Unknown, outcome_class
from app.services import Services

log = logging.getLogger(__name__)

S = TypeVar("S")

# A stored response is replayed byte for byte, so it is kept whole, never
# truncated; and the key table must not become a store of blobs. A larger
# one is a bug, refused before it is stored (the database refuses it too,
# migration 0005).
MAX_STORED_RESPONSE_BYTES = 4096


@dataclass(frozen=True)
class Finished:
    status_code: int
    body: str


@dataclass(frozen=True)
class Pending:
    """The operation is released (or parked) at a SENT point whose outcome is not known yet."""

    subject: Any
    reason: str


class StoredResponseTooLarge(Exception):
    """A bug: a final response over MAX_STORED_RESPONSE_BYTES. Nothing is stored; the operation is not finished."""


# --- Driving -----------------------------------------------------------------------------------------


async def drive(services: Services, op: Operation[S]) -> Finished | Pending:
    """Run the remaining steps of `op`; raises LeaseLost if it is taken over meanwhile.

    Anything that stops a step short (an outcome that is not applied, or an
    exception) is handed to `_give_up`. Only two things leave here as
    exceptions: LeaseLost, and a database that cannot even record the
    give-up (then the lease simply runs out and the next actor resumes). If
    the task is cancelled (a worker or an API process shutting down), the
    lease is given back at once, so the next actor need not wait for it.
    """
    while op.recovery_point != FINISHED:
        bind(op)
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
            log.error("driving the operation at %s was interrupted\n%s", op.recovery_point, loggable(exc))
            result, cause = Unknown(f"interrupted by {type(exc).__name__}"), "error"
        except BaseException:
            await asyncio.shield(_release_now(services, op))
            raise
        if isinstance(result, Operation):
            op = result
            if op.recovery_point == FINISHED:
                report_finished(op)
            continue
        final = isinstance(result, Unknown) and not op.call.repeatable(services, op.subject)
        return await _give_up(services, op, result, final=final, cause=cause)
    assert op.response is not None
    return Finished(*op.response)


async def _step(services: Services, op: Operation[S]) -> Operation[S] | NotApplied | Unknown | Settling:
    """Make the call this recovery point names and record its outcome: the next operation, or why not."""
    crash_at = services.settings.payments_crash_at
    call = op.call
    if call.repeatable(services, op.subject):
        outcome = await _call(services, call, op)
    else:
        outcome = await _call_once(services, call, op)
    if not isinstance(outcome, Applied):
        return outcome
    reached(crash_at, f"after-call-{call.name}")
    after = await one_statement(services.engine, call.record, op, outcome.record, services.settings.lease_seconds)
    assert after.recovery_point in call.leads_to, (call.name, after.recovery_point)
    log.debug("committed %s", after.recovery_point)
    reached(crash_at, f"after-commit-{after.recovery_point}")
    return after


async def _call(services: Services, call: Call[S], op: Operation[S]) -> CallOutcome:
    """A call to a system that deduplicates by our key: probe first when resumed, then send."""
    if op.resumed:
        # A dead or timed-out attempt may have sent this call already: only a
        # definite NotFound lets us send (and even then with the same key).
        found = await call.probe(services, op.subject)
        if isinstance(found, (Applied, Unknown, Settling)):
            return found
    sent = await call.send(services, op.subject)
    if isinstance(sent, Unknown):
        # One cheap probe is worth trying inline: a timed-out call that was
        # applied is then recorded now instead of by the next actor.
        found = await call.probe(services, op.subject)
        if isinstance(found, Applied):
            return found
    return sent


async def _call_once(services: Services, call: Call[S], op: Operation[S]) -> CallOutcome:
    """A call to a system that cannot deduplicate: at most one send that may have landed, ever.

    A resumed owner cannot tell whether the dead one sent it (there is no
    probe), and sending again could pay twice, so it does not send at all.
    Only a release that said the call was certainly not sent (a refused
    connection) lets the next owner send (`op.resumed` is False then).
    """
    if op.resumed:
        return Unknown("the payout may have been sent and this rail can neither be probed nor deduplicate")
    return await call.send(services, op.subject)


async def _give_up(
    services: Services, op: Operation[S], outcome: NotApplied | Unknown | Settling, *, final: bool,
    cause: str | None = None,
) -> Pending:
    """Release the operation for a later attempt, or park it after the last one.

    `final` parks at once: no later attempt could learn more (a legacy rail
    can neither be probed nor safely sent the transfer again). A call that
    was certainly not applied is never final: it is safe to send later. A
    call the system is still settling is polled the same way: each poll an
    attempt, with backoff, parked after the last (then the worker's re-probe
    or reconciliation settles it). `cause` is what metrics count it by: the
    outcome's class, or error when a step raised.
    """
    settings = services.settings
    cause = cause or outcome_class(outcome)
    not_sent = isinstance(outcome, NotApplied)
    if final or op.attempt >= settings.max_attempts:
        subject = await atomic(services.engine, park, op, outcome.reason, settings.parked_recheck_seconds,
                               not_sent=not_sent)
        metrics.counter(metrics.PARKS, op.recovery_point, cause).inc()
        log.warning("parked as indeterminate after attempt %s: %s", op.attempt, outcome.reason)
        return Pending(subject, outcome.reason)
    retry_in = backoff_seconds(op.attempt, settings.backoff_base_seconds, settings.backoff_cap_seconds)
    await one_statement(services.engine, release, op, outcome.reason, retry_in, not_sent=not_sent)
    metrics.counter(metrics.RELEASES, op.recovery_point, cause).inc()
    log.info("released: %s; the worker retries in %.1f s", outcome.reason, retry_in)
    return Pending(op.subject, outcome.reason)


async def _release_now(services: Services, op: Operation[Any]) -> None:
    """Give the lease back without waiting: the process is stopping, nothing failed."""
    try:
        await one_statement(services.engine, release, op, "interrupted: stopping", 0.0, event="stopping, released")
    except LeaseLost:
        pass  # finished or taken over meanwhile: nothing of ours to release
    except Exception as exc:
        log.warning("could not release the operation (%s); its lease will simply expire", describe(exc))
    else:
        metrics.counter(metrics.RELEASES, op.recovery_point, "stopping").inc()
        log.info("stopping: lease given back")


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: about base * 2^(attempt-1), capped.

    The jitter (a random half of the delay) keeps operations that failed
    together, in one outage, from all being retried in the same instant.
    """
    ceiling = min(cap, base * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def bind(op: Operation[Any]) -> None:
    """The operation's fields on every line this task logs from here on (app/observability/logs.py)."""
    logs.bind(
        client_id=op.lease.client_id, key_hash=logs.key_hash(op.lease.key), recovery_point=op.recovery_point,
        attempt=op.attempt, lease_token=str(op.lease.token), **op.machine.log_fields(op.subject),
    )


def report_finished(op: Operation[Any]) -> None:
    """An operation reached its final status here: counted once, by status, and logged at INFO.

    Called right after the phase that finished it committed (by `drive`, or
    by reconciliation when a report settles it), so an operation is counted
    by the one process whose commit finished it.
    """
    bind(op)
    metrics.counter(op.machine.finished, op.subject.status).inc()
    log.info("%s finished: %s", op.machine.name, op.subject.status)


# --- Taking over, healing, settling -----------------------------------------------------------------


async def take_over(
    services: Services, machines: Mapping[str, Machine[Any]], client_id: int, key: str
) -> Operation[Any] | None:
    """Own an operation whose lease ran out or was released (a client retry, or the worker); None if not ours.

    `machines` by endpoint: the key row's endpoint says which machine drives
    it. The one place a takeover is made, counted and logged, whoever makes it.
    """
    op = await atomic(services.engine, take_over_phase, machines, client_id, key, services.settings.lease_seconds)
    if op is not None:
        bind(op)
        metrics.counter(metrics.TAKEOVERS, op.recovery_point).inc()
        log.info("taken over at %s (attempt %s)", op.recovery_point, op.attempt)
    return op


async def take_over_phase(
    conn: AsyncConnection, machines: Mapping[str, Machine[Any]], client_id: int, key: str, lease_seconds: float
) -> Operation[Any] | None:
    """Become the owner of a started operation whose lease has run out.

    Durable after commit: a new lease token and attempt count; the recovery
    point is unchanged, so no completed phase is run again. The previous
    owner, if it is merely slow rather than dead, is fenced off from then on.
    None means someone else holds a live lease (or just took it over).
    """
    taken = await key_table.take_over(conn, client_id, key, lease_seconds, event="taken over")
    if taken is None:
        return None
    lease, not_sent = taken
    row = await key_table.load(conn, client_id, key)
    assert row is not None
    machine = machines[row.endpoint]
    subject = await machine.load(conn, row)
    return Operation(machine, lease, row.recovery_point, subject, resumed=not not_sent, attempt=row.attempts)


async def heal(services: Services, machines: Mapping[str, Machine[Any]], client_id: int, key: str) -> Finished | Pending | None:
    """Ask the external system about a parked operation again; drive it on once it answers.

    Made by the worker every `parked_recheck_seconds` per parked operation.
    A re-probe that learns nothing (still unknown, or still settling) is not
    an attempt: the row keeps its attempts and its timeline, only its next
    re-probe time moves. A probe that answers (applied, or definitely not
    found) takes the operation back (`unpark`, one timeline entry) and drives
    it from its recovery point as any resumer would. A call that cannot be
    probed is left to reconciliation. None: nothing was learned, or someone
    else has it.
    """
    settings = services.settings
    logs.bind(client_id=client_id, key_hash=logs.key_hash(key))
    claimed = await one_statement(services.engine, key_table.claim_recheck, client_id, key, settings.parked_recheck_seconds)
    if claimed is None:
        return None
    row = await read(services.engine, key_table.load, client_id, key)
    if row is None:
        return None
    machine = machines[row.endpoint]
    call = machine.calls[row.recovery_point]
    logs.bind(recovery_point=row.recovery_point)
    subject = await read(services.engine, machine.load, row)
    if not call.repeatable(services, subject):
        return None
    if isinstance(await call.probe(services, subject), (Unknown, Settling)):
        return None
    op = await atomic(services.engine, unpark, machine, client_id, key, settings.lease_seconds, event="re-probe answered")
    if op is None:
        return None
    bind(op)
    metrics.counter(metrics.UNPARKS, op.recovery_point, "reprobe").inc()
    log.info("re-probe of the parked operation at %s answered; resuming", op.recovery_point)
    return await drive(services, op)


async def settle_parked(
    conn: AsyncConnection, machine: Machine[S], client_id: int, key: str, answer: Any, *, lease_seconds: float
) -> Operation[S] | None:
    """A report (a rail's statement, a PSP's settlement report) settles a parked call.

    `answer` is the outcome the report shows, of the same type the call's
    own answer would have had. The parked operation is taken back and the
    answer recorded by the call's declared record phase, exactly as if the
    external system had answered in time. The caller runs this in the same
    transaction as the proof that its reconciliation run still owns its
    window. Durable after commit: whatever that record phase makes durable.
    Crash before commit: still parked; the next run settles it. None if the
    operation is no longer parked (settled by someone else).
    """
    op = await unpark(conn, machine, client_id, key, lease_seconds, event="settled by reconciliation")
    if op is None:
        return None
    assert op.call.settled_by is not None, f"{op.call.name} declares no settlement report"
    after = await op.call.record(conn, op, answer, lease_seconds)
    assert after.recovery_point in op.call.leads_to
    return after


# --- The generic phases --------------------------------------------------------------------------------


async def release(
    conn: AsyncConnection, op: Operation[Any], reason: str, retry_in: float, *,
    event: str = "outcome unknown, released", not_sent: bool = False,
) -> None:
    """Give the operation up at its current SENT point: the outcome is not known yet.

    Durable after commit: the same recovery point, no owner, the reason, and
    when the recovery worker may try again; `not_sent` if this attempt
    certainly sent nothing (the next owner may then send without probing).
    A client retry may take over at once; either probes with the same
    derived key (unless not_sent) and carries on. Nothing is reported as
    failed, because nothing is known to have failed.
    """
    await key_table.release(conn, op.lease, reason, retry_in, event=event, not_sent=not_sent)


async def park(conn: AsyncConnection, op: Operation[S], reason: str, recheck_in: float, *, not_sent: bool = False) -> S:
    """Stop retrying: the outcome stayed unknown through every attempt allowed.

    Durable after commit: the key row is parked at its SENT point with no
    owner, due for a re-probe in `recheck_in` seconds, and whatever the
    machine's `on_park` writes (a payment becomes `indeterminate`, with its
    event). Nobody resumes it blindly from here: the worker's re-probe or
    reconciliation takes it back once it has learned something.
    Crash before commit: nothing changed; once the lease runs out the next
    attempt takes over, probes once more, and parks it if still unknown.
    """
    await key_table.park(conn, op.lease, reason, recheck_in, event="parked", not_sent=not_sent)
    return await op.machine.on_park(conn, op)


async def unpark(
    conn: AsyncConnection, machine: Machine[S], client_id: int, key: str, lease_seconds: float, *, event: str
) -> Operation[S] | None:
    """Take a parked operation back, by someone who has learned something about it.

    Durable after commit: the key row is unparked with a new lease (one more
    attempt, the event on the timeline) and whatever the machine's
    `on_unpark` writes (a payment is `processing` again). The new owner
    resumes at the same recovery point, probing first.
    Crash after commit: the lease runs out and the recovery worker resumes it.
    None if it is not parked any more (somebody else took it back first).
    """
    taken = await key_table.unpark(conn, client_id, key, lease_seconds, event=event)
    if taken is None:
        return None
    lease, attempt = taken
    row = await key_table.load(conn, client_id, key)
    assert row is not None
    parked = Operation(machine, lease, row.recovery_point, await machine.load(conn, row), resumed=True, attempt=attempt)
    return replace(parked, subject=await machine.on_unpark(conn, parked))


# --- What a phase of an operation's module calls ---------------------------------------------------------


async def advance(
    conn: AsyncConnection, op: Operation[S], statement: Statement, to: str, *,
    lease_seconds: float, event: str, **values: Any,
) -> Operation[S]:
    """Run a phase's statement that moves the operation to SENT point `to`; LeaseLost if fenced off."""
    row = await fenced(conn, statement, op.lease, recovery_point=to, lease_seconds=lease_seconds, event=event,
                       **values)
    return replace(op, recovery_point=to, subject=changed(op.subject, row), resumed=False)


async def finish(
    conn: AsyncConnection, op: Operation[S], statement: Statement, *,
    status_code: int, body: str, event: str, event_type: str, **values: Any,
) -> Operation[S]:
    """Run a phase's statement that finishes the operation: its response stored, its event emitted."""
    row = await fenced(conn, statement, op.lease, recovery_point=FINISHED, response_code=status_code,
                       response_body=storable(body), event=event, event_type=event_type, **values)
    return replace(op, recovery_point=FINISHED, subject=changed(op.subject, row), response=(status_code, body))


def changed(subject: S, row: Mapping[str, Any]) -> S:
    """The subject after a phase: as the owner held it, with the columns the phase's statement returned.

    A phase's statement returns every column it sets (or its whole row: the
    same answer at more cost); the rest stay as the owner last read them.
    So it must also return any column someone else may change while the
    operation is owned (app/payments/phases.py says which, for a payment).
    """
    return replace(subject, **row)  # type: ignore[type-var]


def storable(body: str) -> str:
    """`body`, whole, if it may be stored as a final response; StoredResponseTooLarge (a bug) if not."""
    size = len(body.encode())
    if size > MAX_STORED_RESPONSE_BYTES:
        raise StoredResponseTooLarge(f"a {size}-byte response; the cap is {MAX_STORED_RESPONSE_BYTES}")
    return body


async def fenced(conn: AsyncConnection, statement: Statement, lease: Lease, **params: Any) -> Mapping[str, Any]:
    """Run a fenced statement under `lease`: the row it returns, or LeaseLost if the fence held nothing."""
    row = await statement.fetch_one(
        conn, dict(client_id=lease.client_id, key=lease.key, token=lease.token, stored_on=lease.stored_on, **params)
    )
    if row is None:
        raise LeaseLost(f"lease on {lease.key!r} was taken over; this attempt must stop")
    return row
