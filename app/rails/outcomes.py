"""The five things an exchange with the PSP or the rail can tell us.

Where it sits: between the rail clients and the engine. app/rails/gateways.py
reduces every HTTP exchange to one of these, so the engine never interprets
status codes, exceptions or response bodies itself:

    Applied     a record for our key, with a documented final status (a decline is one too)
    NotApplied  certainly nothing done: refused before sending, or a refusal that stores nothing
    Settling    held but not decided yet: probed with backoff, never sent again
    NotFound    (probes only) no record for our key
    Unknown     we cannot tell: never a failure, a decline or a reason to refund

Only Applied may finish a phase. docs/glossary.md defines each, and what
the others' `reason` may say.
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
