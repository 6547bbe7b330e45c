"""The SQL of the hot-path phases: each phase is one statement.

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
    SELECT * FROM updated           -- the payment as the phase left it

Every business write reads from the fence, so a stale owner's statement
changes no row at all, exactly as a rolled-back transaction would; the caller
sees no row come back and raises LeaseLost. The fence comes first in the chain,
so the key row is locked before the payment row, the same order as in every
other phase: two attempts can never deadlock each other.

Why fold: one round trip per phase instead of five (BEGIN, key row, payment
row, ledger, COMMIT), which is most of the difference between this service and
its unsafe twin (docs/performance.md). The durable facts and the fencing are
exactly those of a phase written as separate statements in a transaction.
"""

from __future__ import annotations

from sqlalchemy import text

from app.idempotency.store import ADVANCE_SQL, CLAIM_SQL, FINISH_SQL

# Handler1: claim the key and create the payment, in one statement.
#
# If the claim inserts a key row but the payment insert finds the reference
# already taken, the key row would name a payment that does not exist. Its
# foreign key to payment is DEFERRABLE INITIALLY DEFERRED, so PostgreSQL checks
# it when the statement ends, refuses, and rolls the whole statement back,
# claim included: a duplicate reference leaves no trace. (The caller turns
# that refusal into 409 duplicate-payment.)
HANDLER1 = text(
    f"""
    WITH claim AS ({CLAIM_SQL}
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

# The ledger legs of one posting, for the payment the statement just updated.
_POST = """
    , posted AS (
        INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
        SELECT updated.id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
          FROM updated,
               unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
                 AS leg(account, debit, credit)
    )
"""


def _phase(fence: str, payment_update: str, *, posts: bool) -> text:
    return text(
        f"""
        WITH fence AS ({fence}
        ), updated AS (
            UPDATE payment SET {payment_update}, updated_at = now()
              FROM fence
             WHERE payment.id = fence.payment_id
            RETURNING payment.*
        ){_POST if posts else ""}
        SELECT * FROM updated
        """
    )


# record_charge, charge succeeded: advance to EXT2_SENT, record the charge and
# the payout instruction (Handler2), post charge_captured.
CHARGE_CAPTURED = _phase(
    ADVANCE_SQL,
    "psp_charge_id = :charge_id, end_to_end_reference = :e2e, rail_transfer_key = :transfer_key, "
    "payout_instructed_at = now()",
    posts=True,
)
# record_charge, card declined: finish with the stored response.
CHARGE_DECLINED = _phase(
    FINISH_SQL,
    "status = 'declined', psp_charge_id = :charge_id, decline_code = :decline_code",
    posts=False,
)
# record_transfer, rail accepted (Handler3): finish, post payout_sent.
PAYOUT_SENT = _phase(
    FINISH_SQL,
    "status = 'succeeded', rail_transfer_id = :transfer_id",
    posts=True,
)
# record_transfer, rail rejected: advance to EXT3_SENT with the refund's key.
PAYOUT_REJECTED = _phase(
    ADVANCE_SQL,
    "rail_transfer_id = :transfer_id, reject_reason = :reject_reason, psp_refund_key = :refund_key",
    posts=False,
)
# record_refund: finish as failed, post charge_refunded.
CHARGE_REFUNDED = _phase(
    FINISH_SQL,
    "status = 'failed', psp_refund_id = :refund_id",
    posts=True,
)
