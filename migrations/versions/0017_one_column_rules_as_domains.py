"""An optimisation: the one-column rules of the tables a new payment writes become domains, read once per connection.

A table's CHECK constraint is kept in the catalogue as the text of its
parsed expression. PostgreSQL reads that text back into an expression, and
prepares it, on every statement that inserts or updates a row of the table:
for every CHECK of the table, whichever columns the statement sets. A new
payment writes `payment` three times, `idempotency_key` three times,
`ledger_entry` twice and `event` once, and before this revision each of
those writes read back every CHECK of its table: the largest single cost
in the server's instructions per payment (measured in
docs/reference/performance.md, "Where the database's instructions go").

A domain is a type with the rule attached, and PostgreSQL reads a domain's
rule once per connection (its type cache) and checks it where a value of the
type is made: a column of the domain is checked when a statement writes that
column, and not otherwise. So every rule about one column becomes a domain,
with the same condition, and the column takes the domain as its type:

| domain | rule | columns |
|---|---|---|
| `positive_minor` | `> 0` | `payment.amount_minor`, `payment.net_minor` |
| `nonnegative_minor` | `>= 0` | `payment.fee_minor`, `ledger_entry.debit_minor`, `ledger_entry.credit_minor` |
| `payment_status` | one of the seven statuses | `payment.status` |
| `key_state` | `started` or `finished` | `idempotency_key.state` |
| `stored_response` | at most 4,096 bytes | `idempotency_key.response_body` |
| `event_type` | `word.word`, lower case | `event.type` |

The rules that tie columns together stay CHECKs of their tables (a domain
sees one value): the net amount, the refunded amount within the charge, the
reference held by status, a finished key with its response, a ledger leg on
one side. A value that breaks a domain's rule is refused with the same error
as before (SQLSTATE 23514, check_violation); only the constraint's name in
the message changes.

Existing rows: every value already satisfies its domain's rule, because the
table's CHECK it replaces held it, and nothing writes between the CHECK's
drop and the domain's rule taking its place (the same transaction holds the
table's lock). The domains' rules are therefore added NOT VALID: PostgreSQL
checks every value written from then on, and does not scan the tables to
check again what the dropped CHECKs already checked (ALTER DOMAIN ...
VALIDATE CONSTRAINT would hold a SHARE lock on each table for the scan, and
writes would wait).

On a large table: a column's type changed to a domain over the same base
type, which has no rule yet at that moment, is a catalogue change that
rewrites no table, and an index on the column keeps its storage. One kind
of index is built again: one whose WHERE names the column, which here is
the key table's two indexes of unfinished (and of parked) keys, on
`state`. Each build reads its partition whole under the key table's ACCESS
EXCLUSIVE lock (claims and lookups wait), and writes only the unfinished
keys, a handful.
The table-wide CHECKs that name a changed column are dropped and added again
NOT VALID in the transaction (else PostgreSQL would check them again with a
scan under the table's ACCESS EXCLUSIVE lock), and validated after it
commits, reading each table under a SHARE UPDATE EXCLUSIVE lock that lets
reads and writes go on. The downgrade is the simple way back: the CHECKs are
added again validated, a scan of each table under its lock. Timed on a
million payments in docs/reference/performance.md, "Migration 0017 on a
million payments".

A service of the previous revision still running against the new schema
writes the same values, but one of its statements is refused: recording a
compensating refund (CHARGE_REFUNDED in app/payments/phases.py) reads its
status parameter as text in one place and assigns it to `status` in the
other, and PostgreSQL will not take one parameter as the domain in one
place and text in the other. That phase rolls back and is retried with
backoff, on whichever process owns the payment next; the refund at the PSP
is not made again (its key is derived). Stop the old service first, or
upgrade both at once, as `payments migrate` before `payments api` does.

Revision ID: 0017
Revises: 0016
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

STATUSES = ("processing", "succeeded", "declined", "failed", "indeterminate", "returned", "refunded")
_IN_STATUSES = ", ".join(f"'{s}'" for s in STATUSES)

# (domain, base type, its rule)
DOMAINS = (
    ("positive_minor", "bigint", "VALUE > 0"),
    ("nonnegative_minor", "bigint", "VALUE >= 0"),
    ("payment_status", "text", f"VALUE IN ({_IN_STATUSES})"),
    ("key_state", "text", "VALUE IN ('started', 'finished')"),
    ("stored_response", "text", "octet_length(VALUE) <= 4096"),
    ("event_type", "text", "VALUE ~ '^[a-z_]+\\.[a-z_]+$'"),
)

# (table, column, domain, the table's CHECK it replaces, that CHECK's rule)
COLUMNS = (
    ("payment", "amount_minor", "positive_minor", "payment_amount_minor_check", "amount_minor > 0"),
    ("payment", "net_minor", "positive_minor", "payment_net_minor_check", "net_minor > 0"),
    ("payment", "fee_minor", "nonnegative_minor", "payment_fee_minor_check", "fee_minor >= 0"),
    ("payment", "status", "payment_status", "payment_status_check", f"status IN ({_IN_STATUSES})"),
    ("ledger_entry", "debit_minor", "nonnegative_minor", "ledger_entry_debit_minor_check", "debit_minor >= 0"),
    ("ledger_entry", "credit_minor", "nonnegative_minor", "ledger_entry_credit_minor_check", "credit_minor >= 0"),
    ("idempotency_key", "state", "key_state", "idempotency_key_state_check", "state IN ('started', 'finished')"),
    ("idempotency_key", "response_body", "stored_response", "idempotency_key_response_body_capped",
     "octet_length(response_body) <= 4096"),
    ("event", "type", "event_type", "event_type_check", "type ~ '^[a-z_]+\\.[a-z_]+$'"),
)

# The table-wide CHECKs that name a column above: (table, name, rule), as the earlier revisions made them.
TIES = (
    ("payment", "payment_check", "net_minor = amount_minor - fee_minor"),
    ("payment", "payment_refunded_within_amount", "refunded_minor >= 0 AND refunded_minor <= amount_minor"),
    ("payment", "payment_holds_reference_by_status", "holds_reference = (status NOT IN ('declined', 'failed'))"),
    ("ledger_entry", "ledger_entry_check", "(debit_minor = 0) <> (credit_minor = 0)"),
    ("idempotency_key", "idempotency_key_check",
     "(state = 'finished') = (response_code IS NOT NULL AND response_body IS NOT NULL)"),
)


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    for domain, base, _ in DOMAINS:
        op.execute(f"CREATE DOMAIN {domain} AS {base}")
    for table, name, _ in TIES:
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    for table, column, domain, check, _ in COLUMNS:
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {check}")
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE {domain}")
    # The indexes whose WHERE names `state` were built again, and PostgreSQL named each partition's new one
    # itself; the legacy partition's had names of their own (migration 0006), given back here.
    for parent in ("idempotency_key_unfinished", "idempotency_key_parked"):
        own = parent.replace("idempotency_key_", "idempotency_key_legacy_")
        op.execute(
            f"""
            DO $$ DECLARE built regclass; BEGIN
                SELECT i.inhrelid::regclass INTO built
                  FROM pg_inherits i JOIN pg_index x ON x.indexrelid = i.inhrelid
                 WHERE i.inhparent = '{parent}'::regclass AND x.indrelid = 'idempotency_key_legacy'::regclass;
                IF built IS NOT NULL AND built::text <> '{own}' THEN
                    EXECUTE format('ALTER INDEX %s RENAME TO {own}', built);
                END IF;
            END $$
            """
        )
    for domain, _, rule in DOMAINS:
        op.execute(f"ALTER DOMAIN {domain} ADD CONSTRAINT {domain}_check CHECK ({rule}) NOT VALID")
    for table, name, rule in TIES:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({rule}) NOT VALID")
    with op.get_context().autocommit_block():
        for table, name, _ in TIES:
            op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def downgrade() -> None:
    for table, name, _ in TIES:
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    for table, column, domain, check, rule in COLUMNS:
        base = next(b for d, b, _ in DOMAINS if d == domain)
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE {base}")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {check} CHECK ({rule})")
    for table, name, rule in TIES:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({rule})")
    for domain, _, _ in DOMAINS:
        op.execute(f"DROP DOMAIN {domain}")
