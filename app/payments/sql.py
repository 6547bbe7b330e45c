"""The SQL of the hot-path phases, each written out whole: what runs is what you read.

A phase runs as a single statement with no BEGIN and no COMMIT around it:
PostgreSQL runs a lone statement as a transaction of its own, which commits
completely when the statement ends, or not at all. Each statement is a chain
of data-modifying CTEs:

    fence     UPDATE the key row WHERE lease_token = :token (our lease)
              RETURNING payment_id  -- no row if our lease was taken over
    updated   UPDATE the payment row ... FROM fence
              -- joins the fence, so it changes nothing without it
    posted    INSERT the ledger legs ... SELECT ... FROM updated
              -- likewise
    emitted   INSERT the event a client must hear about ... FROM fence
    queued    INSERT its webhook delivery ... FROM emitted
              -- only in the phases that finish a payment; likewise
    SELECT * FROM updated           -- the payment as the phase left it

Every business write reads from the fence, so a stale owner's statement
changes no row at all, exactly as a rolled-back transaction would; the caller
sees no row come back and raises LeaseLost. The fence comes first in the chain,
so the key row is locked before the payment row, the same order as in every
other phase: two attempts can never deadlock each other.

There are two fences: one that advances the recovery point to the next SENT
point (ADVANCE_SQL in app/idempotency/store.py) and one that finishes the
operation and stores its response (FINISH_SQL). They are written out inside
each statement below so that a reader sees every statement whole;
tests/unit/test_phase_sql.py proves each copy is, word for word, the fence
it names, so the copies cannot drift apart.

Why fold: one round trip per phase instead of five (BEGIN, key row, payment
row, ledger, COMMIT), which is most of the difference between this service and
its unsafe twin (docs/reference/performance.md). The durable facts and the fencing are
exactly those of a phase written as separate statements in a transaction.
"""

from __future__ import annotations

from sqlalchemy import text

# phases.handler1: claim the key and create the payment -> EXT1_SENT.
#
# The claim is the fence of this phase: claim_idempotency_key inserts the key
# row and returns its lease token, or, if the key exists in any day's
# partition, returns nothing, and then nothing else happens either
# (CLAIM_SQL in app/idempotency/store.py says how it stays unique across
# days). If the claim inserts a key row but the payment insert finds the
# reference already taken, the key row would name a payment that does not
# exist. Its foreign key to payment is DEFERRABLE INITIALLY DEFERRED, so
# PostgreSQL checks it when the statement ends, refuses, and rolls the whole
# statement back, claim included: a duplicate reference leaves no trace.
# (The caller turns that refusal into 409 duplicate-payment.)
HANDLER1 = text(
    """
    WITH claim AS (
        SELECT claimed.lease_token
          FROM claim_idempotency_key(:client_id, :key, :endpoint, :request_hash, :recovery_point,
                                     :payment_id, :lease_seconds) AS claimed(lease_token)
         WHERE claimed.lease_token IS NOT NULL
    ), created AS (
        INSERT INTO payment
            (id, client_id, reference, amount_minor, currency, fee_minor, net_minor,
             card_token, beneficiary_name, beneficiary_iban, status, psp_charge_key)
        SELECT :payment_id, :client_id, :reference, :amount, :currency, :fee, :net,
               :card_token, :beneficiary_name, :beneficiary_iban, 'processing', :psp_charge_key
          FROM claim                                   -- only under a claim we won
        ON CONFLICT (client_id, reference) WHERE status NOT IN ('declined', 'failed') DO NOTHING
        RETURNING *
    )
    SELECT claim.lease_token, created.* FROM claim, created
    """
)

# phases.record_charge, the charge succeeded (Handler2): advance to EXT2_SENT,
# record the charge and build the payout instruction, post charge_captured.
CHARGE_CAPTURED = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET recovery_point = :recovery_point,
               lease_expires_at = now() + make_interval(secs => :lease_seconds),
               last_error = NULL,
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET psp_charge_id = :charge_id, end_to_end_reference = :e2e, rail_transfer_key = :transfer_key,
               payout_instructed_at = now(), updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    ), posted AS (
        INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
        SELECT updated.id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
          FROM updated,
               unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
                 AS leg(account, debit, credit)
    )
    SELECT * FROM updated
    """
)

# phases.record_charge, the card was declined: finish, with the stored response.
CHARGE_DECLINED = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET state = 'finished',
               recovery_point = :recovery_point,
               response_code = :response_code,
               response_body = :response_body,
               lease_token = NULL,
               lease_expires_at = NULL,
               last_error = NULL,
               finished_at = now(),
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET status = 'declined', psp_charge_id = :charge_id, decline_code = :decline_code, updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    ), emitted AS (
        INSERT INTO event (client_id, payment_id, type, data)
        SELECT :client_id, fence.payment_id, CAST(:event_type AS text), CAST(:response_body AS json)
          FROM fence
        RETURNING id, client_id
    ), queued AS (
        INSERT INTO webhook_delivery (event_id, client_id)
        SELECT emitted.id, emitted.client_id
          FROM emitted JOIN webhook_endpoint ON webhook_endpoint.client_id = emitted.client_id
    )
    SELECT * FROM updated
    """
)

# phases.record_transfer, the rail accepted (Handler3): finish, post payout_sent.
PAYOUT_SENT = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET state = 'finished',
               recovery_point = :recovery_point,
               response_code = :response_code,
               response_body = :response_body,
               lease_token = NULL,
               lease_expires_at = NULL,
               last_error = NULL,
               finished_at = now(),
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET status = 'succeeded', rail_transfer_id = :transfer_id, updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    ), posted AS (
        INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
        SELECT updated.id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
          FROM updated,
               unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
                 AS leg(account, debit, credit)
    ), emitted AS (
        INSERT INTO event (client_id, payment_id, type, data)
        SELECT :client_id, fence.payment_id, CAST(:event_type AS text), CAST(:response_body AS json)
          FROM fence
        RETURNING id, client_id
    ), queued AS (
        INSERT INTO webhook_delivery (event_id, client_id)
        SELECT emitted.id, emitted.client_id
          FROM emitted JOIN webhook_endpoint ON webhook_endpoint.client_id = emitted.client_id
    )
    SELECT * FROM updated
    """
)

# phases.record_transfer, the rail rejected: advance to EXT3_SENT with the
# refund's derived key K3 (the compensation is intended, not yet made).
PAYOUT_REJECTED = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET recovery_point = :recovery_point,
               lease_expires_at = now() + make_interval(secs => :lease_seconds),
               last_error = NULL,
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET rail_transfer_id = :transfer_id, reject_reason = :reject_reason, psp_refund_key = :refund_key,
               updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    )
    SELECT * FROM updated
    """
)

# phases.record_refund: finish as failed, post charge_refunded.
CHARGE_REFUNDED = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET state = 'finished',
               recovery_point = :recovery_point,
               response_code = :response_code,
               response_body = :response_body,
               lease_token = NULL,
               lease_expires_at = NULL,
               last_error = NULL,
               finished_at = now(),
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET status = 'failed', psp_refund_id = :refund_id, updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    ), posted AS (
        INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
        SELECT updated.id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
          FROM updated,
               unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
                 AS leg(account, debit, credit)
    ), emitted AS (
        INSERT INTO event (client_id, payment_id, type, data)
        SELECT :client_id, fence.payment_id, CAST(:event_type AS text), CAST(:response_body AS json)
          FROM fence
        RETURNING id, client_id
    ), queued AS (
        INSERT INTO webhook_delivery (event_id, client_id)
        SELECT emitted.id, emitted.client_id
          FROM emitted JOIN webhook_endpoint ON webhook_endpoint.client_id = emitted.client_id
    )
    SELECT * FROM updated
    """
)

# phases.record_return_refund: the compensation of a returned payout finishes:
# the card is refunded, status refunded, post charge_refunded. (The fence is
# the compensation's own key row, app/payments/returns.py; its payment_id is
# the returned payment.)
RETURN_REFUNDED = text(
    """
    WITH fence AS (
        UPDATE idempotency_key
           SET state = 'finished',
               recovery_point = :recovery_point,
               response_code = :response_code,
               response_body = :response_body,
               lease_token = NULL,
               lease_expires_at = NULL,
               last_error = NULL,
               finished_at = now(),
               updated_at = now(),
               timeline = timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text),
                                                         'recovery_point', CAST(:recovery_point AS text),
                                                         'attempt', attempts)
         WHERE client_id = :client_id AND key = :key
           AND lease_token = :token AND state = 'started'
        RETURNING payment_id
    ), updated AS (
        UPDATE payment
           SET status = 'refunded', psp_refund_id = :refund_id, updated_at = now()
          FROM fence
         WHERE payment.id = fence.payment_id
        RETURNING payment.*
    ), posted AS (
        INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
        SELECT updated.id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
          FROM updated,
               unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
                 AS leg(account, debit, credit)
    ), emitted AS (
        INSERT INTO event (client_id, payment_id, type, data)
        SELECT :client_id, fence.payment_id, CAST(:event_type AS text), CAST(:response_body AS json)
          FROM fence
        RETURNING id, client_id
    ), queued AS (
        INSERT INTO webhook_delivery (event_id, client_id)
        SELECT emitted.id, emitted.client_id
          FROM emitted JOIN webhook_endpoint ON webhook_endpoint.client_id = emitted.client_id
    )
    SELECT * FROM updated
    """
)

# The statements that finish a payment also write its event (and its
# webhook delivery), as the two CTEs of app/outbox/events.py::EMIT_SQL,
# word for word (tests/unit/test_phase_sql.py).
EMITS = ("CHARGE_DECLINED", "PAYOUT_SENT", "CHARGE_REFUNDED", "RETURN_REFUNDED")

# Which fence each statement must carry, word for word (tests/unit/test_phase_sql.py).
FENCES = {
    "HANDLER1": "CLAIM_SQL",
    "CHARGE_CAPTURED": "ADVANCE_SQL",
    "CHARGE_DECLINED": "FINISH_SQL",
    "PAYOUT_SENT": "FINISH_SQL",
    "PAYOUT_REJECTED": "ADVANCE_SQL",
    "CHARGE_REFUNDED": "FINISH_SQL",
    "RETURN_REFUNDED": "FINISH_SQL",
}
