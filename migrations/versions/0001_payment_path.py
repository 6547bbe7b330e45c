"""The exactly-once payment path: clients, the key table, payments, the ledger.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE client (
            id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            name          text NOT NULL,
            -- SHA-256 of the API key: the key itself is shown once and never stored.
            api_key_hash  bytea NOT NULL UNIQUE,
            created_at    timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE payment (
            id                    uuid PRIMARY KEY,
            client_id             bigint NOT NULL REFERENCES client (id),
            -- The client's business identity of the payment (an order, an invoice).
            reference             text NOT NULL,
            amount_minor          bigint NOT NULL CHECK (amount_minor > 0),
            currency              char(3) NOT NULL,
            fee_minor             bigint NOT NULL CHECK (fee_minor >= 0),
            net_minor             bigint NOT NULL CHECK (net_minor > 0),
            card_token            text NOT NULL,
            beneficiary_name      text NOT NULL,
            beneficiary_iban      text NOT NULL,
            status                text NOT NULL
                -- processing: not final (an unknown outcome is still processing);
                -- indeterminate: parked for reconciliation after repeated unknowns.
                CHECK (status IN ('processing', 'succeeded', 'declined', 'failed', 'indeterminate')),
            end_to_end_reference  text UNIQUE,
            psp_charge_key        text,
            psp_charge_id         text,
            decline_code          text,
            rail_transfer_key     text,
            rail_transfer_id      text,
            reject_reason         text,
            psp_refund_key        text,
            psp_refund_id         text,
            created_at            timestamptz NOT NULL DEFAULT now(),
            updated_at            timestamptz NOT NULL DEFAULT now(),
            CHECK (net_minor = amount_minor - fee_minor)
        )
        """
    )
    # Request identity is not business identity: a client that loses its
    # idempotency key and sends a new one still cannot pay an order twice.
    # A payment that ended without moving money (declined, or failed and
    # refunded) no longer holds its reference, so the order can be tried again
    # (with another card, say); one in progress or succeeded always does.
    op.execute(
        "CREATE UNIQUE INDEX payment_reference_in_force ON payment (client_id, reference) "
        "WHERE status NOT IN ('declined', 'failed')"
    )
    op.execute(
        """
        CREATE TABLE idempotency_key (
            client_id         bigint NOT NULL REFERENCES client (id),
            key               text NOT NULL,
            endpoint          text NOT NULL,
            request_hash      bytea NOT NULL,
            state             text NOT NULL CHECK (state IN ('started', 'finished')),
            recovery_point    text NOT NULL,
            -- Deferred, checked when the claiming statement ends: the key row and
            -- its payment are inserted together, and a key row whose payment
            -- could not be created (its reference is taken) is refused, which
            -- rolls the whole claim back (app/payments/sql.py, HANDLER1).
            payment_id        uuid REFERENCES payment (id) DEFERRABLE INITIALLY DEFERRED,
            -- The lease: who owns the operation (a fencing token, new on every
            -- claim or takeover) and until when, by the database's clock.
            lease_token       uuid,
            lease_expires_at  timestamptz,
            attempts          integer NOT NULL DEFAULT 1,
            -- When the recovery worker may next try (exponential backoff after
            -- an unknown outcome); a client retry does not wait for it.
            next_attempt_at   timestamptz NOT NULL DEFAULT now(),
            -- Set when repeated unknown outcomes hand the operation to
            -- reconciliation: nobody resumes it blindly any more.
            parked_at         timestamptz,
            last_error        text,
            response_code     integer,
            response_body     text,
            timeline          jsonb NOT NULL DEFAULT '[]',
            created_at        timestamptz NOT NULL DEFAULT now(),
            updated_at        timestamptz NOT NULL DEFAULT now(),
            finished_at       timestamptz,
            -- Keys are unique per client, never globally: two tenants may both
            -- send "req-001", and neither may ever see the other's response.
            PRIMARY KEY (client_id, key),
            -- A stored response exists exactly when the operation is finished.
            CHECK ((state = 'finished') = (response_code IS NOT NULL AND response_body IS NOT NULL))
        )
        """
    )
    # The recovery worker scans only unfinished keys; finished ones are the vast
    # majority and never need to be looked at again.
    op.execute(
        "CREATE INDEX idempotency_key_unfinished ON idempotency_key (next_attempt_at) "
        "WHERE state = 'started' AND parked_at IS NULL"
    )
    op.execute(
        """
        CREATE TABLE ledger_entry (
            id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            payment_id    uuid NOT NULL REFERENCES payment (id),
            posting       text NOT NULL,
            account       text NOT NULL,
            debit_minor   bigint NOT NULL DEFAULT 0 CHECK (debit_minor >= 0),
            credit_minor  bigint NOT NULL DEFAULT 0 CHECK (credit_minor >= 0),
            currency      char(3) NOT NULL,
            created_at    timestamptz NOT NULL DEFAULT now(),
            CHECK ((debit_minor = 0) <> (credit_minor = 0)),
            -- The last line of defence: a posting lands once per payment and
            -- account, whatever a bug upstream might try.
            UNIQUE (payment_id, posting, account)
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE ledger_entry, idempotency_key, payment, client")
