"""The three things an external call or probe can tell us.

Every HTTP exchange with the PSP or the rail is reduced to one of these, so
the runner never interprets status codes or exceptions itself:

    Applied   the external system has a record for our key: here it is. A
              decline or a rejection is an Applied record too; it is a result.
    NotFound  (probes only) the external system has no record for our key.
    Unknown   we cannot tell whether the call took effect: a timeout, a lost
              response, a 5xx, or transient refusals that outlasted our retries.
              Unknown is never a failure; it is an absence of information.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Applied:
    record: dict[str, Any]


@dataclass(frozen=True)
class NotFound:
    pass


@dataclass(frozen=True)
class Unknown:
    reason: str


CallOutcome = Applied | Unknown
ProbeOutcome = Applied | NotFound | Unknown
