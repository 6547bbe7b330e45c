"""What an operation declares to the engine: where it starts, the call each SENT point makes, and where each leads.

An operation's module (app/payments/payment.py, app/payments/returns.py)
builds one `Machine`. The engine (app/machine/engine.py) reads nothing else
about the operation: a new operation is a new declaration, not a change here.

    Machine   the operation's name, the endpoint stored in its key rows, how
              it starts, the call each SENT recovery point names, and what
              the operation's subject (its business row) does when it is
              parked and taken back.
    Start     the first phase: claims the key and writes the business rows;
              the recovery point it leaves.
    Call      an external call: send (with a derived key), probe (by the
              same key), the phase that records an applied outcome, and the
              recovery points that phase may lead to. `repeatable` says
              whether the system deduplicates, so that probing and sending
              again are safe; `settled_by` names the report reconciliation
              settles a parked call from, when no probe can.
    Operation one operation as its owner holds it between two phases.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import Counter
from sqlalchemy.ext.asyncio import AsyncConnection

from app.idempotency.key_table import KeyRow, Lease
from app.observability import metrics
from app.rails.outcomes import CallOutcome, ProbeOutcome

if TYPE_CHECKING:
    from app.services import Services

FINISHED = "finished"  # the one recovery point every operation ends at

S = TypeVar("S")  # the operation's subject: the business row it moves forward (a Payment)


@dataclass(frozen=True)
class Operation(Generic[S]):
    """One operation as its owner sees it between phases."""

    machine: Machine[S]
    lease: Lease
    recovery_point: str
    subject: S
    # True when an earlier attempt may already have made this point's
    # external call (taken over from a dead owner, or from one that released
    # it after an unknown outcome): the engine probes before it sends. False
    # for a fresh intent, and after a release that said the call was
    # certainly not sent (a refused connection).
    resumed: bool
    attempt: int = 1  # 1 for the first owner, +1 per takeover
    response: tuple[int, str] | None = None  # (status, body), once finished

    @property
    def call(self) -> Call[S]:
        return self.machine.calls[self.recovery_point]


Record = Callable[[AsyncConnection, Operation[S], Any, float], Awaitable[Operation[S]]]


def _always(services: Services, subject: Any) -> bool:
    return True


@dataclass(frozen=True)
class Call(Generic[S]):
    """The external call a SENT recovery point names, and how its outcome is recorded."""

    name: str  # "EXT1": its crash point is after-call-EXT1
    what: str  # one line for people: "charge the card at the PSP with K1"
    send: Callable[[Services, S], Awaitable[CallOutcome]]
    probe: Callable[[Services, S], Awaitable[ProbeOutcome]]
    record: Record[S]  # (conn, op, the applied answer, lease seconds) -> the operation after the phase
    leads_to: tuple[str, ...]  # every recovery point `record` may leave
    # Whether the external system deduplicates this call by its key and
    # answers probes, so that probing and sending again are safe.
    repeatable: Callable[[Services, S], bool] = _always
    # The report reconciliation settles a parked call from (engine.settle_parked), if any.
    settled_by: str | None = None


@dataclass(frozen=True)
class Start:
    """The first phase: the claim and the business rows, in one transaction; the point it leaves.

    For a client's request, `matrix.submit` runs `phase(conn, machine,
    **arguments)`, which returns the operation it claimed, or None when the
    key exists already. An operation started by a message rather than a
    request (a returned payout) runs its start phase where the message
    arrives, in the message's inbox transaction.
    """

    phase: Callable[..., Awaitable[Operation[Any] | None]]
    what: str
    leads_to: str | tuple[str, ...]  # the point it leaves (or each it may leave: a start may refuse and finish)
    # A start phase is one statement, run without BEGIN and COMMIT; one that
    # must decide between two statements (write, or undo and refuse) runs in
    # a transaction instead.
    transaction: bool = False

    @property
    def points(self) -> tuple[str, ...]:
        return (self.leads_to,) if isinstance(self.leads_to, str) else self.leads_to


async def _unchanged(conn: AsyncConnection, op: Operation[Any]) -> Any:
    return op.subject


@dataclass(frozen=True)
class Machine(Generic[S]):
    """One operation's state machine, as the engine drives it."""

    name: str
    endpoint: str  # stored in every key row of this operation: renaming it needs a migration
    start: Start
    calls: Mapping[str, Call[S]]  # SENT recovery point -> the call made there
    # The subject of a key row, for an owner that takes the operation over.
    # (After a phase, the engine applies what its statement returned to the
    # subject it had: app/machine/engine.py::changed.)
    load: Callable[[AsyncConnection, KeyRow], Awaitable[S]]
    # What becomes of the subject when the operation is parked, and when it
    # is taken back from parking (both run in the same transaction as the
    # key row's change). By default it is left as it is.
    on_park: Callable[[AsyncConnection, Operation[S]], Awaitable[S]] = _unchanged
    on_unpark: Callable[[AsyncConnection, Operation[S]], Awaitable[S]] = _unchanged
    # The fields every log line of this operation carries.
    log_fields: Callable[[S], dict[str, str]] = field(default=lambda subject: {})
    # What the metrics count its new keys and its final statuses as: a
    # payment's by default (a returned payout's compensation finishes its
    # payment); a refund has counters of its own.
    started: Counter = metrics.STARTED
    finished: Counter = metrics.FINISHED

    def __post_init__(self) -> None:
        points = {*self.start.points, *(p for c in self.calls.values() for p in c.leads_to)}
        unknown = points - set(self.calls) - {FINISHED}
        if unknown:
            raise ValueError(f"{self.name}: {sorted(unknown)} lead nowhere: no call is declared there")

    def recovery_points(self) -> tuple[str, ...]:
        return (*self.calls, FINISHED)
