"""The four things an external call can tell us, and the probe's answers.

Every HTTP exchange with the PSP or the rail is reduced to one of these by
`app.rails.gateways`, so the engine never interprets status codes, exceptions
or response bodies itself:

    Applied     the external system holds a record for our key, with a status
                it documents as final (app/rails/answers.py). A decline or a
                rejection is an Applied record too: it is a result.
    NotApplied  nothing was done, for certain: the connection was refused
                before a byte of the request was sent, or the system answered
                with a refusal it documents as storing nothing (a 429, say).
                Safe to send again later, even to a rail that cannot
                deduplicate. Never a result: the payment is not over.
    Settling    the external system holds our request but has not decided it
                yet (a slow provider's `pending`): it will settle later, so
                the call is polled (probed) with backoff, never sent again.
    NotFound    (probes only) the external system has no record for our key.
    Unknown     we cannot tell whether the call took effect: a timeout, a lost
                or garbled response, a 5xx, an answer whose status is missing
                or not on the documented list. Unknown is never a failure, a
                decline or a reason to refund; it is an absence of information.

Only Applied may finish a phase. The `reason` of the others is a short
classified phrase ("psp: timed out"), stored on the key row and shown to the
client: never an exception's text, a URL or a response body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from app.rails.answers import Answer

A = TypeVar("A", bound=Answer)


@dataclass(frozen=True)
class Applied(Generic[A]):
    record: A


@dataclass(frozen=True)
class NotApplied:
    reason: str


@dataclass(frozen=True)
class Settling:
    reason: str


@dataclass(frozen=True)
class NotFound:
    pass


@dataclass(frozen=True)
class Unknown:
    reason: str


CallOutcome = Applied | NotApplied | Settling | Unknown
ProbeOutcome = Applied | NotFound | Settling | Unknown


def outcome_class(outcome: Applied | NotApplied | Settling | NotFound | Unknown) -> str:
    """The outcome's class as metrics and logs name it: applied, not_applied, settling, not_found or unknown."""
    return _CLASSES[type(outcome)]


_CLASSES = {
    Applied: "applied", NotApplied: "not_applied", Settling: "settling", NotFound: "not_found", Unknown: "unknown",
}
