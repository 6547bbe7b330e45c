"""An operation's timeline as a diagram: the key row's history, with the calls between its commits.

Where it sits: behind the console's operation page (app/console/routes.py).
The key row's `timeline` holds one entry per commit; the external calls,
never recorded by themselves, are drawn from what is durable: an entry at a
SENT point, the derived key on the payment row (on the refund row, for a
client's refund), and the entry that follows.
`layout` turns that into rows with coordinates; templates/timeline.svg draws
them. Pure functions of the rows, so they are unit-tested without a browser.
docs/console.md#one-operation explains how to read the diagram.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT5_SENT


@dataclass(frozen=True)
class CallSpec:
    system: str  # "psp" or "rail"
    what: str
    key_label: str
    key_field: str  # the subject's (payment's, refund's) column holding the derived key
    id_field: str  # ... and the one holding the external record's id
    outcomes: frozenset[str]  # the timeline events that record this call's applied outcome
    reason_field: str | None = None  # ... and the one saying why it went against us (declined, failed)


CALLS = {
    EXT1_SENT: CallSpec("psp", "charge", "K1", "psp_charge_key", "psp_charge_id",
                        frozenset({"charge succeeded", "charge declined"}), "decline_code"),
    EXT2_SENT: CallSpec("rail", "transfer", "K2", "rail_transfer_key", "rail_transfer_id",
                        frozenset({"transfer accepted", "transfer rejected"}), "reject_reason"),
    EXT3_SENT: CallSpec("psp", "refund", "K3", "psp_refund_key", "psp_refund_id",
                        frozenset({"charge refunded"})),
    # A client's refund (app/payments/refunds/refund.py): its keys are on the refund row.
    EXT5_SENT: CallSpec("psp", "refund the card", "K5", "psp_refund_key", "psp_refund_id",
                        frozenset({"refund succeeded", "refund failed"}), "failure_code"),
}

# What kind of step each event is: the colour and shape it is drawn with.
KINDS = {
    "claimed": "commit",
    "charge succeeded": "commit",
    "charge declined": "commit",
    "transfer accepted": "commit",
    "transfer rejected": "commit",
    "charge refunded": "commit",
    "refund succeeded": "commit",
    "refund failed": "commit",
    "taken over": "takeover",
    "outcome unknown, released": "release",
    "stopping, released": "release",
    "parked": "park",
    "re-probe answered": "unpark",
    "settled by reconciliation": "unpark",
}

# Geometry (SVG user units). The key row's lane, then the PSP's and the rail's.
WIDTH = 980
LANE_X = {"key": 360, "psp": 640, "rail": 880}
TOP = 56
EVENT_HEIGHT = 44
CALL_HEIGHT = 56
TAKEOVER_HEIGHT = 30


@dataclass(frozen=True)
class EventRow:
    y: int
    kind: str  # commit | takeover | release | park | unpark | other
    event: str
    recovery_point: str
    attempt: int
    offset: str  # time since the first entry, "+1.234 s"


@dataclass(frozen=True)
class CallRow:
    y: int
    system: str
    x_to: int
    what: str  # "charge with K1"
    key: str  # the derived key (or the end-to-end reference a probe uses), shortened for the drawing
    outcome: str
    result: str  # applied | unknown | cut | pending | statement
    resumed: bool


@dataclass(frozen=True)
class Band:
    """A takeover: a new attempt owns the operation from here on."""

    y: int
    text: str


@dataclass(frozen=True)
class Diagram:
    width: int
    height: int
    lanes: dict[str, int]
    events: list[EventRow]
    calls: list[CallRow]
    bands: list[Band]
    lane_bottom: int


def layout(timeline: list[dict[str, Any]], payment: dict[str, Any], *, finished: bool, lease_live: bool) -> Diagram:
    """Rows, top to bottom, of one operation's history; `payment` is the row its calls' keys are on
    (the payment's, or a client refund's)."""
    events: list[EventRow] = []
    calls: list[CallRow] = []
    bands: list[Band] = []
    y = TOP
    start = _when(timeline[0]["at"]) if timeline else None
    for i, entry in enumerate(timeline):
        event = str(entry.get("event", ""))
        # A refusal ("refused: refund-exceeds-payment") is the commit that finishes a refused request.
        kind = KINDS.get(event, "commit" if event.startswith("refused: ") else "other")
        attempt = int(entry.get("attempt", 0))
        if kind in ("takeover", "unpark"):
            before = int(timeline[i - 1].get("attempt", 0)) if i else 0
            bands.append(Band(y, f"attempt {attempt} takes over" + (
                f" from attempt {before} (its lease had run out)" if kind == "takeover" else f": {event}")))
            y += TAKEOVER_HEIGHT
        offset = (_when(entry["at"]) - start).total_seconds() if start else 0.0
        events.append(EventRow(y, kind, event, str(entry.get("recovery_point", "")), attempt, f"+{offset:.3f} s"))
        y += EVENT_HEIGHT
        call = _call_after(entry, timeline[i + 1] if i + 1 < len(timeline) else None, payment,
                           finished=finished, lease_live=lease_live)
        if call is not None:
            calls.append(CallRow(y, *call))
            y += CALL_HEIGHT
    return Diagram(WIDTH, y + 16, LANE_X, events, calls, bands, y)


def _call_after(entry: dict[str, Any], following: dict[str, Any] | None, payment: dict[str, Any], *,
                finished: bool, lease_live: bool) -> tuple | None:
    """The call the owner made (or may have made) after `entry`, and how it ended, as CallRow's fields."""
    spec = CALLS.get(str(entry.get("recovery_point")))
    event = entry.get("event")
    # Nothing is called after a finish, by nobody (after a release or a
    # park, until the next attempt takes it over), and a payout settled by
    # reconciliation was learned from the rail's statement, recorded in the
    # same transaction as the settlement: no call either.
    if spec is None or KINDS.get(str(event)) in ("release", "park") or event == "settled by reconciliation":
        return None
    following_event = following.get("event") if following else None
    resumed = event in ("taken over", "re-probe answered")
    key = f"{spec.key_label} {_short(payment.get(spec.key_field))}"
    what = f"{spec.what} with {spec.key_label}" if not resumed else (
        f"probe by {'end-to-end ref.' if spec.system == 'rail' else spec.key_label}, "
        f"then {spec.what} with {spec.key_label} only if not found")
    if following_event in spec.outcomes:
        record_id = payment.get(spec.id_field) or "-"
        reason = payment.get(spec.reason_field) if spec.reason_field else None
        outcome = f"{following_event.split()[-1]} · {record_id}" + (f" ({reason})" if reason else "")
        return spec.system, LANE_X[spec.system], what, key, outcome, "applied", resumed
    if following_event in ("outcome unknown, released", "parked"):
        return (spec.system, LANE_X[spec.system], what, key,
                "no applied answer: " + ("parked" if following_event == "parked" else "released, retried later"),
                "unknown", resumed)
    if following_event == "stopping, released":
        return spec.system, LANE_X[spec.system], what, key, "interrupted: the process was stopping", "unknown", resumed
    if following_event == "taken over":
        return (spec.system, LANE_X[spec.system], what, key,
                "no outcome recorded: this attempt died or stalled past its lease", "cut", resumed)
    if following is None and not finished:
        return (spec.system, LANE_X[spec.system], what, key,
                "in flight (lease live)" if lease_live else "waiting for the next attempt", "pending", resumed)
    return None


def _short(value: Any, keep: int = 16) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= keep else text[:keep] + "…"


def _when(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
