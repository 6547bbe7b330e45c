"""Millions of realistic key rows and their payments, written inside PostgreSQL.

Through the API the machine makes a hundred or two payments a second: ten
million would take most of a day. Here one statement per chunk (INSERT ...
SELECT over generate_series, the payment and its key row in one statement)
writes tens of thousands of rows a second, and the rows look like the ones the
service writes itself:

    the key          a random UUID (what clients send), unique per client; its
                     request_hash is the real fingerprint of the body the bench
                     sends (so a preloaded key can be replayed through the API),
                     its stored response the service's own rendering of the
                     payment (checked by `check_rendering`), its timeline the
                     events the phases append, at plausible offsets
    the payment      a time-ordered id (UUIDv7, of its creation time, as
                     new_payment_id makes), a reference unique per client
                     (`order-<n>`), the derived PSP/rail keys and end-to-end
                     reference computed as app/idempotency/keys.py computes them
    the day          created_at spread evenly over the span given (the
                     retention window, or one old day), `stored_on` its UTC day,
                     so each row lands in its day's partition
    the outcome      mostly succeeded; 3% declined, 1% refunded after a rail
                     rejection, and a few not finished: parked for reconciliation (payment
                     `indeterminate`) or waiting to be retried after an unknown
                     outcome (payment `processing`), see Mix

Clients: the rows are dealt round robin to several clients, the bench's own
among them, so the bench's client has its share of a large table.

No ledger rows. The ledger is append-only with time-ordered keys (an identity
id, and a unique (payment_id, ...) index whose payment ids are UUIDv7): a new
entry lands at the right-hand edge of each index whatever the table's size, so
its size hardly changes the cost of a new payment, and five ledger rows per
payment would multiply the preload's time and disk by three. The payments
exist, so a preloaded key's foreign key and its reference's uniqueness are
real.

A later, larger size adds rows spread over the same window: their payment ids
interleave in time with the earlier ones', so the payment table's primary key
is less densely packed than one built strictly in time order would be (a
larger index, the pessimistic side).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from app.idempotency.keys import canonical_json, request_fingerprint
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.payment import PAYMENT
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, FINISHED, STEP_CHARGE, STEP_REFUND, STEP_TRANSFER
from bench.load import payment_body

# Rows per statement: big enough that a statement's overhead vanishes, small
# enough that the foreign-key checks a chunk queues until its commit stay a few MB.
CHUNK = 50_000
DECLINED_CARD = "tok_decline"
REFERENCE_PLACEHOLDER = "order-0"


@dataclass(frozen=True)
class Mix:
    """How many rows in a million are not plain successes, by outcome."""

    parked: int = 1_000  # started, parked for reconciliation after repeated unknown outcomes
    unfinished: int = 200  # started, released after an unknown outcome, due to be retried
    failed: int = 10_000  # charged, rejected by the rail, refunded: finished, status failed
    declined: int = 30_000  # declined by the PSP: finished, status declined


# The retention window: what a busy day leaves behind. The old days of the
# drop-vs-DELETE comparison: by then retries have long finished and
# reconciliation has settled nearly every park; a few stragglers stay, which
# the reaper must move out before it drops the day.
WINDOW_MIX = Mix()
OLD_DAY_MIX = Mix(parked=100, unfinished=0)


def _bind(sql: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    """`:name` placeholders -> asyncpg's `$n`, with the values in order."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return re.sub(r"(?<!:):([a-z_]+)", number, sql), [params[n] for n in names]


def _derived(step: str, row: str = "d") -> str:
    # app/idempotency/keys.py::derived_key, in SQL: sha256 of "client \x1f key \x1f step", hex.
    return (f"encode(sha256(convert_to({row}.client_id::text || chr(31) || {row}.key || chr(31) || '{step}', "
            "'UTF8')), 'hex')")


# One chunk: the rows numbered [lo, hi). Each CTE names what it adds.
_LOAD = f"""
WITH k AS (  -- the parameters, each typed once
    SELECT CAST(:clients AS bigint[]) AS clients,
           CAST(:start AS timestamptz) AS start,
           CAST(:first AS bigint) AS first,
           CAST(:step AS interval) AS step,
           CAST(:lo AS bigint) AS lo,
           CAST(:hi AS bigint) AS hi,
           CAST(:parked AS bigint) AS parked,
           CAST(:unfinished AS bigint) AS unfinished,
           CAST(:failed AS bigint) AS failed,
           CAST(:declined AS bigint) AS declined,
           CAST(:amount AS bigint) AS amount,
           CAST(:currency AS text) AS currency,
           CAST(:fee AS bigint) AS fee,
           CAST(:net AS bigint) AS net,
           CAST(:card AS text) AS card,
           CAST(:beneficiary_name AS text) AS beneficiary_name,
           CAST(:beneficiary_iban AS text) AS beneficiary_iban,
           CAST(:endpoint AS text) AS endpoint,
           CAST(:head AS text) AS head,
           CAST(:declined_head AS text) AS declined_head,
           CAST(:tail AS text) AS tail
), s AS MATERIALIZED (
    SELECT n,
           k.clients[1 + n % cardinality(k.clients)] AS client_id,
           gen_random_uuid()::text AS key,
           'order-' || n AS reference,
           k.start + (n - k.first) * k.step AS created_at,
           -- u: a multiplicative hash of n in [0, 1e6), so that outcomes do not line up with clients (n % clients)
           CASE WHEN u < k.parked THEN 'parked'
                WHEN u < k.parked + k.unfinished THEN 'unfinished'
                WHEN u < k.parked + k.unfinished + k.failed THEN 'failed'
                WHEN u < k.parked + k.unfinished + k.failed + k.declined THEN 'declined'
                ELSE 'succeeded' END AS outcome
      FROM k, generate_series(k.lo, k.hi - 1) AS n,
           LATERAL (SELECT (n * 2654435761) % 4294967296 % 1000000 AS u) AS hashed
), d AS MATERIALIZED (
    SELECT s.*,
           -- UUIDv7: 48 bits of Unix milliseconds, the version nibble 7, random bits (variant kept)
           encode(set_byte(r.b, 6, (get_byte(r.b, 6) & 15) | 112), 'hex')::uuid AS payment_id,
           -- written with the payment since migration 0014; the payout is instructed for these
           'E2E' || upper(left({_derived('e2e', 's')}, 32)) AS e2e,
           s.outcome IN ('succeeded', 'failed', 'parked') AS instructed,
           CASE s.outcome WHEN 'succeeded' THEN 'succeeded' WHEN 'declined' THEN 'declined'
                          WHEN 'failed' THEN 'failed' WHEN 'parked' THEN 'indeterminate'
                          ELSE 'processing' END AS status,
           s.created_at + CASE s.outcome WHEN 'declined' THEN interval '150 ms' WHEN 'failed' THEN interval '400 ms'
                                         ELSE interval '250 ms' END AS finished_at
      FROM k, s,
           LATERAL (SELECT overlay(uuid_send(gen_random_uuid())
                                   PLACING substring(int8send(floor(extract(epoch FROM s.created_at) * 1000)::bigint)
                                                     FROM 3)
                                   FROM 1 FOR 6) AS b) AS r
), p AS (
    INSERT INTO payment
        (id, client_id, reference, amount_minor, currency, fee_minor, net_minor, card_token,
         beneficiary_name, beneficiary_iban, status, end_to_end_reference, psp_charge_key, psp_charge_id,
         decline_code, rail_transfer_key, rail_transfer_id, reject_reason, psp_refund_key, psp_refund_id,
         created_at, updated_at, payout_instructed_at, holds_reference)
    SELECT d.payment_id, d.client_id, d.reference, k.amount, k.currency, k.fee, k.net,
           CASE WHEN d.outcome = 'declined' THEN '{DECLINED_CARD}' ELSE k.card END,
           k.beneficiary_name, k.beneficiary_iban, d.status, d.e2e,
           {_derived(STEP_CHARGE)},
           CASE WHEN d.outcome <> 'unfinished' THEN 'ch_' || left(md5(d.key || 'ch'), 24) END,
           CASE WHEN d.outcome = 'declined' THEN 'card_declined' END,
           CASE WHEN d.instructed THEN {_derived(STEP_TRANSFER)} END,
           CASE WHEN d.outcome IN ('succeeded', 'failed') THEN 'tr_' || left(md5(d.key || 'tr'), 24) END,
           CASE WHEN d.outcome = 'failed' THEN 'account_closed' END,
           CASE WHEN d.outcome = 'failed' THEN {_derived(STEP_REFUND)} END,
           CASE WHEN d.outcome = 'failed' THEN 're_' || left(md5(d.key || 're'), 24) END,
           d.created_at,
           CASE WHEN d.outcome IN ('parked', 'unfinished') THEN d.created_at + interval '2 min' ELSE d.finished_at END,
           CASE WHEN d.instructed THEN d.created_at + interval '150 ms' END,
           d.status NOT IN ('declined', 'failed')
      FROM k, d
)
INSERT INTO idempotency_key
    (client_id, key, stored_on, endpoint, request_hash, state, recovery_point, payment_id, lease_token,
     lease_expires_at, attempts, next_attempt_at, parked_at, last_error, response_code, response_body,
     timeline, created_at, updated_at, finished_at, not_sent)
SELECT d.client_id, d.key, (d.created_at AT TIME ZONE 'UTC')::date, k.endpoint,
       sha256(convert_to(CASE WHEN d.outcome = 'declined' THEN k.declined_head ELSE k.head END
                         || d.reference || k.tail, 'UTF8')),
       CASE WHEN d.outcome IN ('parked', 'unfinished') THEN 'started' ELSE 'finished' END,
       CASE d.outcome WHEN 'parked' THEN '{EXT2_SENT}' WHEN 'unfinished' THEN '{EXT1_SENT}' ELSE '{FINISHED}' END,
       d.payment_id, NULL, NULL,
       CASE d.outcome WHEN 'parked' THEN 4 WHEN 'unfinished' THEN 2 ELSE 1 END,
       CASE d.outcome WHEN 'parked' THEN d.created_at + interval '12 min'
                      WHEN 'unfinished' THEN d.created_at + interval '40 s' ELSE d.created_at END,
       CASE WHEN d.outcome = 'parked' THEN d.created_at + interval '2 min' END,
       CASE d.outcome WHEN 'parked' THEN 'rail: no answer within the timeout, 4 times'
                      WHEN 'unfinished' THEN 'psp: no answer within the timeout' END,
       CASE WHEN d.outcome IN ('parked', 'unfinished') THEN NULL ELSE 201 END,
       CASE WHEN d.outcome NOT IN ('parked', 'unfinished') THEN format(
           '{{"id":"%s","object":"payment","status":"%s","reference":"%s","amount":%s,"currency":"%s","fee":%s,'
           '"net_amount":%s,"beneficiary":{{"name":"%s","iban":"%s"}},"end_to_end_reference":%s,"failure":%s,'
           '"created_at":"%s"}}',
           d.payment_id, d.status, d.reference, k.amount, k.currency, k.fee, k.net, k.beneficiary_name, k.beneficiary_iban,
           CASE WHEN d.instructed THEN '"' || d.e2e || '"' ELSE 'null' END,  -- as PaymentView shows it
           CASE d.outcome
                WHEN 'declined' THEN '{{"stage":"charge","code":"card_declined","message":"The card was declined '
                                     'by the PSP; nothing was charged."}}'
                WHEN 'failed' THEN '{{"stage":"payout","code":"account_closed","message":"The payout did not reach '
                                   'the beneficiary; the charge was refunded in full."}}'
                ELSE 'null' END,
           -- As pydantic writes it: all six digits of the microseconds, none when they are all zero.
           replace(to_char(d.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || 'Z', '.000000Z', 'Z'))
       END,
       CASE d.outcome
            WHEN 'succeeded' THEN jsonb_build_array(
                jsonb_build_object('at', d.created_at, 'event', 'claimed', 'attempt', 1, 'recovery_point', '{EXT1_SENT}'),
                jsonb_build_object('at', d.created_at + interval '150 ms', 'event', 'charge succeeded', 'attempt', 1,
                                   'recovery_point', '{EXT2_SENT}'),
                jsonb_build_object('at', d.finished_at, 'event', 'transfer accepted', 'attempt', 1,
                                   'recovery_point', '{FINISHED}'))
            WHEN 'declined' THEN jsonb_build_array(
                jsonb_build_object('at', d.created_at, 'event', 'claimed', 'attempt', 1, 'recovery_point', '{EXT1_SENT}'),
                jsonb_build_object('at', d.finished_at, 'event', 'charge declined', 'attempt', 1,
                                   'recovery_point', '{FINISHED}'))
            WHEN 'failed' THEN jsonb_build_array(
                jsonb_build_object('at', d.created_at, 'event', 'claimed', 'attempt', 1, 'recovery_point', '{EXT1_SENT}'),
                jsonb_build_object('at', d.created_at + interval '150 ms', 'event', 'charge succeeded', 'attempt', 1,
                                   'recovery_point', '{EXT2_SENT}'),
                jsonb_build_object('at', d.created_at + interval '250 ms', 'event', 'transfer rejected', 'attempt', 1,
                                   'recovery_point', '{EXT3_SENT}'),
                jsonb_build_object('at', d.finished_at, 'event', 'charge refunded', 'attempt', 1,
                                   'recovery_point', '{FINISHED}'))
            WHEN 'parked' THEN jsonb_build_array(
                jsonb_build_object('at', d.created_at, 'event', 'claimed', 'attempt', 1, 'recovery_point', '{EXT1_SENT}'),
                jsonb_build_object('at', d.created_at + interval '150 ms', 'event', 'charge succeeded', 'attempt', 1,
                                   'recovery_point', '{EXT2_SENT}'),
                jsonb_build_object('at', d.created_at + interval '10 s', 'event', 'outcome unknown, released',
                                   'attempt', 1, 'recovery_point', '{EXT2_SENT}'),
                jsonb_build_object('at', d.created_at + interval '2 min', 'event', 'parked', 'attempt', 4,
                                   'recovery_point', '{EXT2_SENT}'))
            ELSE jsonb_build_array(
                jsonb_build_object('at', d.created_at, 'event', 'claimed', 'attempt', 1, 'recovery_point', '{EXT1_SENT}'),
                jsonb_build_object('at', d.created_at + interval '10 s', 'event', 'outcome unknown, released',
                                   'attempt', 1, 'recovery_point', '{EXT1_SENT}'))
       END,
       d.created_at,
       CASE WHEN d.outcome IN ('parked', 'unfinished') THEN d.created_at + interval '2 min' ELSE d.finished_at END,
       CASE WHEN d.outcome IN ('parked', 'unfinished') THEN NULL ELSE d.finished_at END,
       false
  FROM k, d
"""


def _fingerprint_parts(card: str) -> tuple[str, str]:
    """What app/idempotency/keys.py::request_fingerprint hashes, split around the reference.

    The bench's body (bench/load.py) validated by the service's own model and
    written canonically, with the reference cut out: head + reference + tail
    is the hashed text of any reference that JSON writes as itself (ours are
    `order-<n>`). Checked against request_fingerprint itself, so a change in
    how the service fingerprints fails here instead of making every replay
    of a preloaded key a 422.
    """
    def body(reference: str) -> dict[str, Any]:
        request = json.loads(payment_body(reference)) | {"card_token": card}
        return PaymentRequest.model_validate(request).model_dump(mode="json")

    text = f"POST\n/v1/payments\n{canonical_json(body(REFERENCE_PLACEHOLDER)).decode()}"
    head, tail = text.split(json.dumps(REFERENCE_PLACEHOLDER))
    head, tail = head + '"', '"' + tail
    probe = "order-12345"
    if hashlib.sha256((head + probe + tail).encode()).digest() != request_fingerprint("POST", "/v1/payments", body(probe)):
        raise RuntimeError("the preload's fingerprint no longer matches app/idempotency/keys.py::request_fingerprint")
    return head, tail


def load_params(clients: list[int], first: int, start: datetime, step_us: float, mix: Mix) -> dict[str, Any]:
    """The parameters every chunk of one load shares."""
    body = json.loads(payment_body(REFERENCE_PLACEHOLDER))
    head, tail = _fingerprint_parts(body["card_token"])
    declined_head, declined_tail = _fingerprint_parts(DECLINED_CARD)
    assert declined_tail == tail  # the card comes before the reference in canonical (sorted) order
    fee = fee_for(body["amount"])
    return {
        "clients": clients, "first": first, "start": start, "step": timedelta(microseconds=step_us),
        "parked": mix.parked, "unfinished": mix.unfinished,
        "failed": mix.failed, "declined": mix.declined,
        "amount": body["amount"], "currency": body["currency"], "fee": fee, "net": body["amount"] - fee,
        "card": body["card_token"], "beneficiary_name": body["beneficiary"]["name"],
        "beneficiary_iban": body["beneficiary"]["iban"], "endpoint": PAYMENT.endpoint,
        "head": head, "declined_head": declined_head, "tail": tail,
    }


async def load(url: str, clients: list[int], lo: int, hi: int, start: datetime, end: datetime, mix: Mix,
               progress: Callable[[int, float], None] = lambda done, seconds: None, connections: int = 2) -> float:
    """Rows numbered [lo, hi) created evenly over [start, end), in chunks over `connections`; the seconds it took.

    Each chunk is one statement, a transaction of its own: a load interrupted
    halfway leaves whole chunks, each key with its payment. Several
    connections write chunks side by side (PostgreSQL runs one statement on
    one core).

    Foreign-key checks are skipped while loading, as pg_restore
    --disable-triggers does (session_replication_role = replica, which needs
    a superuser; without one they run, and the load is slower): every row
    is made with its payment in the same statement and for a client that
    exists, so the checks would only slow the load. Nothing else the
    tables enforce is skipped: primary keys, unique indexes and CHECKs all apply.
    """
    step_us = (end - start).total_seconds() * 1e6 / max(1, hi - lo)
    params = load_params(clients, lo, start, step_us, mix)
    chunks = [(c, min(hi, c + CHUNK)) for c in range(lo, hi, CHUNK)]
    done = 0
    started = time.monotonic()

    async def writer() -> None:
        nonlocal done
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("SET work_mem = '64MB'")  # a chunk's CTEs stay in memory
            try:
                await conn.execute("SET session_replication_role = replica")
            except asyncpg.InsufficientPrivilegeError:
                pass
            while chunks:
                chunk_lo, chunk_hi = chunks.pop(0)
                sql, args = _bind(_LOAD, params | {"lo": chunk_lo, "hi": chunk_hi})
                await conn.execute(sql, *args)
                done += chunk_hi - chunk_lo
                progress(done, time.monotonic() - started)
        finally:
            await conn.close()

    await asyncio.gather(*(writer() for _ in range(max(1, connections))))
    return time.monotonic() - started


async def check_rendering(conn: asyncpg.Connection, sample: int = 20) -> list[str]:
    """Preloaded finished rows whose stored response is not what the service would render; [] if all are.

    The service renders a payment with PaymentView.of(payment).body(); a
    preloaded response that differs would make the replays of preloaded keys
    answer bytes the service never writes.
    """
    rows = await conn.fetch(
        "SELECT p.*, k.response_body FROM idempotency_key k JOIN payment p ON p.id = k.payment_id "
        "WHERE k.state = 'finished' AND p.reference LIKE 'order-%' "
        "AND p.status = ANY($1::text[]) ORDER BY p.id DESC LIMIT $2",
        ["succeeded", "declined", "failed"], sample,
    )
    wrong = []
    for row in rows:
        fields = {k: row[k] for k in Payment.__dataclass_fields__}
        rendered = PaymentView.of(Payment(**fields)).body()
        if rendered != row["response_body"]:
            wrong.append(f"{row['reference']}: stored {row['response_body']!r}, the service renders {rendered!r}")
    return wrong


async def vacuum_analyze(conn: asyncpg.Connection) -> float:
    """VACUUM (ANALYZE) the two preloaded tables, as autovacuum eventually would; the seconds it took.

    Done at once rather than left to autovacuum, which would otherwise set
    the hint bits and visibility map of millions of fresh rows in the middle
    of a measured run.
    """
    started = time.monotonic()
    await conn.execute("VACUUM (ANALYZE) payment")
    await conn.execute("VACUUM (ANALYZE) idempotency_key")
    await conn.execute("CHECKPOINT")
    return time.monotonic() - started

