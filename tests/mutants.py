"""Break it on purpose: each mutant breaks one safety rule, and the tests must catch every one.

    python -m tests.mutants            # every mutant (`make mutants`)
    python -m tests.mutants --list     # what each one changes, and the tests that must catch it
    python -m tests.mutants fence probe  # only these

A green suite proves little if it would also be green with the protection
gone. So each mutant below is a small, deliberate bug, an exact piece of
source text replaced by another, that breaks one rule of docs/crash-matrix.md
("Break it yourself"). For each one, this script copies the tree (every file
git knows, committed or not, ignored ones left out) into a temporary
directory, applies the mutant there, and runs the few tests chosen to catch
it, in that copy. The working tree is never touched. Two copies' tests run
at a time (`--jobs`), each in a pytest session, a database and processes of
its own: most of a mutant's time is spent waiting on the processes its
tests start, so two at once take not much longer than one.

The copy is put first on PYTHONPATH, so the test process and every process
it spawns (`payments`, `fake-psp`, `fake-rail`, which are the virtualenv's
console scripts) import the mutated code: the editable install's finder comes
after sys.path (site-packages' __editable__ finder is appended to
sys.meta_path, behind the path finder). This is checked for every mutant: a
subprocess started outside the copy must import each mutated module from it.

A mutant is KILLED when its tests fail (pytest exit code 1) and SURVIVED
when they pass; anything else (a test id that no longer exists, a collection
error, a timeout) is an ERROR, not a kill. A mutant may also name tests that
must still pass (`still_pass`): they prove the mutant is well-formed and that
the kill comes from behaviour. Before the mutants, the tests are run once on the
unmutated copy (the baseline), split into as many sessions at once as the
mutants will run (fewer only if there are fewer test ids), so that they pass
under the same load: a kill means nothing if they fail anyway.

The exit status is non-zero if any mutant survives, errs, or no longer finds
its source text exactly as many times as it expects: the list cannot rot
silently when the code it mutates changes.

With DATABASE_URL set, the tests use that server (each run makes its own
database); without it, the embedded PostgreSQL is started once here (the
same one as `make test`) and every run uses it. A server with too few
connections for two sessions at once (PostgreSQL's default of 100 has room
for one, as in `make test`) gets one at a time.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from devtools import processes

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_SECONDS = 600
JOBS = 2  # pytest sessions at once, each a copy of its own (--jobs)


@dataclass(frozen=True)
class Edit:
    """Replace `find` by `replace` in `path`; `find` must occur exactly `count` times."""

    path: str
    find: str
    replace: str
    count: int = 1


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    still_pass: tuple[str, ...] = field(default=())


CRASH = "tests/crash/test_crash_matrix.py::"
API = "tests/integration/test_payments_api.py::"
PHASES = "tests/integration/test_phases.py::"
KEYS = "tests/integration/test_key_table.py::"
REFUNDS = "tests/integration/test_refunds.py::"
REFUND_RACES = "tests/integration/test_refund_races.py::"
REFUND_CRASH = "tests/crash/test_refund_crashes.py::"
# The claim's function, as the head's last migration to replace it (0015) writes it.
CLAIM_FUNCTION = "migrations/versions/0015_key_looks_skip_the_days_ahead.py"

MUTANTS = (
    Mutant(
        "fence",
        "a phase commits only under its own lease (the fence checks the lease token)",
        (
            Edit(
                "app/idempotency/key_table.py",
                "       AND lease_token = :token AND state = 'started'\n    RETURNING payment_id",
                "       AND state = 'started'\n    RETURNING payment_id",
                count=2,  # ADVANCE_SQL, FINISH_SQL: the fence of every statement built from them
            ),
        ),
        (
            PHASES + "test_a_phase_run_under_a_lease_that_was_taken_over_writes_nothing",
            CRASH + "test_a_stalled_owner_cannot_commit_after_its_operation_was_taken_over",
        ),
    ),
    Mutant(
        "probe",
        "a resumer probes before it sends, and sends nothing the probe found",
        (
            Edit(
                "app/machine/engine.py",
                "    if op.resumed:\n        # A dead or timed-out attempt",
                "    if False:  # MUTANT: a resumer sends without probing\n        # A dead or timed-out attempt",
            ),
        ),
        (
            CRASH + "test_a_resumer_probes_before_it_sends_and_never_resends_what_the_probe_found[after-call-EXT1]",
            CRASH + "test_a_resumer_probes_before_it_sends_and_never_resends_what_the_probe_found[after-call-EXT2]",
        ),
    ),
    Mutant(
        "random-key",
        "the key sent to the PSP and the rail is derived from (client, key, step), never random",
        (
            Edit(
                "app/idempotency/keys.py",
                "    return hashlib.sha256(material).hexdigest()",
                "    return __import__('uuid').uuid4().hex  # MUTANT: a random key",
            ),
        ),
        (
            "tests/unit/test_keys.py::test_derived_keys_are_deterministic_and_distinct_per_client_key_and_step",
            API + "test_a_new_payment_charges_once_pays_out_once_and_balances_the_ledger",
        ),
    ),
    Mutant(
        "open-transaction",
        "no transaction (and no pooled connection) is held while the PSP or the rail is called",
        (
            Edit(
                "app/machine/engine.py",
                "        outcome = await _call(services, call, op)\n",
                "        async def holding(conn):  # MUTANT: the call made inside an open transaction\n"
                "            await keys.load(conn, op.lease.client_id, op.lease.key)\n"
                "            return await _call(services, call, op)\n"
                "        outcome = await atomic(services.engine, holding)\n",
            ),
        ),
        (API + "test_no_transaction_is_held_open_while_the_psp_is_called",),
    ),
    Mutant(
        "final-503",
        "an unknown outcome is released, never stored as the final response",
        (
            Edit(
                "app/idempotency/key_table.py",
                "       SET lease_token = NULL,\n           lease_expires_at = NULL,\n           last_error = :error,\n"
                "           not_sent = :not_sent,\n           next_attempt_at",
                "       SET state = 'finished', response_code = 503, response_body = :error,  -- MUTANT\n"
                "           lease_token = NULL,\n           lease_expires_at = NULL,\n           last_error = :error,\n"
                "           not_sent = :not_sent,\n           next_attempt_at",
            ),
        ),
        (API + "test_an_unknown_outcome_answers_202_and_a_retry_completes_it_once",),
    ),
    Mutant(
        "fingerprint",
        "a key reused for a different request is refused (422), never treated as a retry",
        (
            Edit(
                "app/machine/matrix.py",
                "    if row.endpoint != machine.endpoint or row.request_hash != request_hash:\n",
                "    if row.endpoint != machine.endpoint:  # MUTANT: the fingerprint is not compared\n",
            ),
        ),
        (
            API + "test_the_same_key_with_a_different_body_is_rejected_with_422_and_changes_nothing",
            API + "test_a_different_body_is_rejected_even_while_the_first_attempt_is_in_flight",
        ),
    ),
    Mutant(
        "takeover",
        "only an operation whose lease has run out may be taken over",
        (
            Edit(
                "app/idempotency/key_table.py",
                "       AND k.state = 'started' AND k.parked_at IS NULL\n"
                "       AND (k.lease_expires_at IS NULL OR k.lease_expires_at < now())\n",
                "       AND k.state = 'started' AND k.parked_at IS NULL  -- MUTANT: live leases too\n",
            ),
        ),
        (
            PHASES + "test_a_live_lease_cannot_be_taken_over_and_an_expired_one_can",
            CRASH + "test_of_two_concurrent_retries_after_a_crash_exactly_one_takes_over",
        ),
    ),
    Mutant(
        "legacy-resend",
        "a payout to a rail that cannot deduplicate is never sent again by a resumer",
        (
            Edit(
                "app/machine/engine.py",
                '    if op.resumed:\n        return Unknown("the payout may have been sent',
                '    if False:  # MUTANT: a resumer sends the legacy payout again\n'
                '        return Unknown("the payout may have been sent',
            ),
        ),
        (
            "tests/reconciliation/test_reconciliation.py::"
            "test_a_crash_around_a_legacy_payout_parks_it_and_never_sends_it_twice[after-call-EXT2-1]",
        ),
    ),
    Mutant(
        "refund-key",
        "the refund is sent with its derived key K3, so a resumer finds it instead of refunding again",
        (
            Edit(
                "app/payments/payment.py",
                "            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.amount_minor),",
                "            send=lambda s, p: s.psp.refund(__import__('uuid').uuid4().hex, p, amount=p.amount_minor),  # MUTANT: a fresh key",
            ),
            Edit(  # the refund of a returned payout (K4), the other operation's call
                "app/payments/returns.py",
                "            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.return_refund_minor),",
                "            send=lambda s, p: s.psp.refund(__import__('uuid').uuid4().hex, p, amount=p.return_refund_minor),  # MUTANT: a fresh key",
            ),
        ),
        (
            API + "test_a_rail_rejection_is_compensated_by_exactly_one_refund",
            CRASH + "test_a_resumer_probes_before_it_sends_and_never_resends_what_the_probe_found[after-call-EXT3]",
        ),
    ),
    Mutant(
        "return-takes-all",
        "a returned payout's compensation refunds only what the client's refunds left, never the whole charge again",
        (
            Edit(
                "app/payments/returns.py",
                "            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.return_refund_minor),",
                "            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.amount_minor),  # MUTANT: all of it",
            ),
        ),
        (
            "tests/crash/test_returns.py::"
            "test_a_return_after_a_client_refund_compensates_only_what_is_left_across_a_crash[the recovery worker]",
        ),
        still_pass=(
            "tests/crash/test_returns.py::"
            "test_a_crash_after_the_compensating_refund_was_sent_is_finished_with_that_one_refund[the recovery worker]",
        ),
    ),
    Mutant(
        "duplicate-reference",
        "a reference belongs to one live payment: a second key for it is refused 409 duplicate-payment",
        (
            Edit(
                "app/payments/phases.py",
                "        ON CONFLICT (client_id, reference) WHERE holds_reference DO NOTHING\n",
                "",
            ),
        ),
        (
            API + "test_a_new_key_for_an_already_paid_reference_is_409_and_pays_nothing",
            PHASES + "test_handler1_for_a_taken_reference_leaves_no_key_row",
        ),
    ),
    Mutant(
        "claim-lock",
        "two claims of one key are serialised, so one waits for the other even across midnight",
        (
            Edit(
                CLAIM_FUNCTION,
                "        PERFORM pg_advisory_xact_lock(hashtextextended(p_client_id::text || '/' || p_key, 0));\n",
                "        -- MUTANT: no lock: concurrent claims look before either commits\n",
            ),
        ),
        (
            KEYS + "test_concurrent_posts_of_one_key_straddling_midnight_make_one_key_one_payment_one_charge",
            KEYS + "test_a_claim_held_open_across_midnight_makes_a_second_claim_of_its_key_wait_and_find_it",
        ),
    ),
    Mutant(
        "claim-look",
        "a claim looks for its key in every day's partition before it inserts one for today",
        (
            Edit(
                CLAIM_FUNCTION,
                "        PERFORM 1 FROM idempotency_key WHERE client_id = p_client_id AND key = p_key{bound};\n"
                "        IF FOUND THEN\n            RETURN NULL;\n        END IF;\n",
                "        -- MUTANT: no look: only today's partition's primary key is checked\n",
            ),
        ),
        (
            KEYS + "test_a_retry_just_after_midnight_finds_yesterdays_key_and_claims_no_second_one",
            KEYS + "test_a_claim_held_open_across_midnight_makes_a_second_claim_of_its_key_wait_and_find_it",
        ),
    ),
    Mutant(
        "claim-look-margin",
        "a claim's look reaches the day after its own, where a claim that began after midnight stores its key",
        (
            Edit(
                CLAIM_FUNCTION,
                "        AS $$ SELECT key_table_day() + 1 $$\n",
                "        AS $$ SELECT key_table_day() $$  -- MUTANT: no margin for a claim begun before midnight\n",
            ),
        ),
        (KEYS + "test_a_claim_whose_day_is_still_before_midnight_finds_a_key_claimed_just_after_it",),
    ),
    Mutant(
        "cursor-xmin",
        "the webhook cursor reads only events of transactions older than every one still running",
        (
            Edit(
                "app/outbox/delivery.py",
                "AND e.written_by < pg_snapshot_xmin(pg_current_snapshot())\n",
                "-- MUTANT: the cursor reads whatever is committed\n",
                count=2,  # the read's, and the lease's look for something to read
            ),
        ),
        ("tests/integration/test_webhook_cursor.py::test_the_cursor_never_moves_past_an_event_whose_transaction_is_still_open",),
        ("tests/integration/test_webhook_cursor.py::test_a_moved_batch_writes_each_attempts_rows_as_the_attempt_left_them",),
    ),
    Mutant(
        "cursor-position",
        "a dispatcher leases the webhook cursor only where it read it from, never after another moved it",
        (
            Edit(
                "app/outbox/delivery.py",
                "           AND (c.written_by, c.event_id) = (position.written_by, position.event_id)\n",
                "           -- MUTANT: the lease is taken wherever the cursor is now\n",
            ),
        ),
        ("tests/integration/test_webhook_cursor.py::"
         "test_a_read_that_waited_for_a_move_does_not_lease_the_batch_it_read_before_it",),
        ("tests/integration/test_webhook_cursor.py::test_a_batch_moved_after_its_lease_was_taken_over_writes_nothing",),
    ),
    Mutant(
        "cursor-delivery-row",
        "the webhook cursor sends no first attempt for an event that already has a delivery row",
        (
            Edit(
                "app/outbox/delivery.py",
                "               WHERE d.event_id = e.id AND w.client_id IS NOT NULL\n",
                "               WHERE false  -- MUTANT: every event is taken to have no delivery row\n",
            ),
        ),
        ("tests/integration/test_webhook_cursor.py::"
         "test_an_event_that_already_has_a_delivery_row_is_passed_over_not_sent_again",),
        ("tests/integration/test_webhook_cursor.py::"
         "test_a_payment_writes_its_event_only_and_the_cursor_sends_those_of_clients_with_an_endpoint",),
    ),
    Mutant(
        "list-drop",
        "every event a batch of first attempts reads is sent: one past a full list starts the next list",
        (
            Edit(
                "app/outbox/delivery.py",
                "        if current is None or len(current) == claimed.events_per_post:\n",
                "        if current is not None and len(current) == claimed.events_per_post:\n"
                "            continue  # MUTANT: an event past a full list is passed over, never sent\n"
                "        if current is None:\n",
            ),
        ),
        ("tests/unit/test_webhook_decisions.py::"
         "test_a_batch_goes_out_in_lists_of_each_endpoints_size_in_its_order_and_every_other_event_alone",
         "tests/crash/test_webhook_lists.py::"
         "test_waiting_events_go_in_lists_of_the_endpoints_size_each_signed_and_applied_once"),
        ("tests/crash/test_webhook_lists.py::test_an_endpoint_that_asked_for_one_event_a_post_gets_one",),
    ),
    Mutant(
        "egress-address",
        "the webhook dispatcher connects only to addresses the egress policy permits, judged after resolution",
        (
            Edit(
                "app/outbox/egress.py",
                "    kept = [info for info in found if policy.permits(str(info[4][0]))]\n",
                "    kept = list(found)  # MUTANT: every address the host resolves to is connected to\n",
            ),
        ),
        ("tests/unit/test_webhook_egress.py::test_the_dispatcher_connects_to_no_refused_address_and_says_one_phrase_for_all",
         "tests/unit/test_webhook_egress.py::test_a_name_that_resolves_inside_at_delivery_is_refused_though_it_was_registered"),
        ("tests/unit/test_webhook_egress.py::test_https_is_delivered_to_a_certificate_of_the_ca_the_settings_trust",),
    ),
    Mutant(
        "refund-reservation",
        "a client refund reserves its amount only if what is left of the payment covers it, else a clean 409",
        (
            Edit(
                "app/payments/refunds/phases.py",
                "\n           AND coalesce(CAST(:amount AS bigint), locked.remaining) BETWEEN 1 AND locked.remaining",
                "  -- MUTANT: no guard; only the CHECK is left",
            ),
        ),
        (
            REFUNDS + "test_a_refund_larger_than_what_is_left_is_refused_and_refunds_nothing",
            REFUNDS + "test_a_full_refund_takes_what_is_left_and_a_second_one_finds_nothing",
            REFUND_RACES + "test_fifty_partial_refunds_at_once_on_two_apis_refund_no_more_than_the_charge",
        ),
        # A refund within what is left still goes through: the mutant breaks only the guard.
        still_pass=(REFUNDS + "test_a_partial_refund_is_refunded_once_posted_and_replayed_byte_for_byte",),
    ),
    Mutant(
        "refund-lock",
        "a refund's reservation reads what is left under the payment's row lock, so racing refunds see each other",
        (
            Edit(
                "app/payments/refunds/phases.py",
                "\n           FOR UPDATE OF payment\n",
                "\n",
            ),
        ),
        (
            REFUND_RACES + "test_fifty_partial_refunds_at_once_on_two_apis_refund_no_more_than_the_charge",
            REFUND_RACES + "test_ten_full_refunds_at_once_on_two_apis_refund_the_charge_once",
        ),
        # One refund alone is unaffected: the mutant breaks only what a race needs.
        still_pass=(REFUNDS + "test_a_partial_refund_is_refunded_once_posted_and_replayed_byte_for_byte",),
    ),
    Mutant(
        "refund-key-derived",
        "a client refund is sent with its derived key K5, so a resumer finds it instead of refunding again",
        (
            Edit(
                "app/payments/refunds/refund.py",
                "            send=lambda s, r: s.psp.client_refund(r.psp_refund_key, r),",
                "            send=lambda s, r: s.psp.client_refund(__import__('uuid').uuid4().hex, r),  # MUTANT: a fresh key",
            ),
        ),
        (
            REFUND_CRASH + "test_a_client_retry_after_a_crash_completes_the_refund_exactly_once[after-call-EXT5]",
            REFUND_CRASH
            + "test_a_resumed_refund_probes_the_psp_first_and_never_resends_what_the_probe_found[after-call-EXT5]",
        ),
        # Without a crash, one send: the refund is made once whatever its key.
        still_pass=(REFUNDS + "test_a_partial_refund_is_refunded_once_posted_and_replayed_byte_for_byte",),
    ),
)


# --- The copy -------------------------------------------------------------------


def copy_tree(destination: Path) -> None:
    """Every file git knows here (tracked, or untracked and not ignored), as it is on disk now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if not source.exists():  # deleted in the working tree, not yet committed
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def lines_of(text: str, find: str) -> list[int]:
    """The 1-based line of each occurrence of `find` in `text`."""
    lines, start = [], 0
    while (at := text.find(find, start)) != -1:
        lines.append(text.count("\n", 0, at) + 1)
        start = at + max(len(find), 1)
    return lines


def where(mutant: Mutant) -> str:
    """file:line,line... of every change, in the source as it is now (or the problem)."""
    places = []
    for edit in mutant.edits:
        text = (ROOT / edit.path).read_text()
        found = lines_of(text, edit.find)
        places.append(f"{edit.path}:{','.join(map(str, found)) or 'NOT FOUND'}")
    return " ".join(places)


def stale_edits(mutant: Mutant) -> list[str]:
    """Why the mutant can no longer be applied as written (empty if it can)."""
    problems = []
    for edit in mutant.edits:
        found = (ROOT / edit.path).read_text().count(edit.find)
        if found != edit.count:
            problems.append(f"{edit.path}: its text is found {found} times, not {edit.count}")
    return problems


def apply(mutant: Mutant, tree: Path) -> None:
    for edit in mutant.edits:
        path = tree / edit.path
        text = path.read_text()
        assert text.count(edit.find) == edit.count, (mutant.name, edit.path)
        path.write_text(text.replace(edit.find, edit.replace))


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def check_visible(mutant: Mutant, tree: Path, env: dict[str, str]) -> str | None:
    """None if a fresh subprocess (as `payments` would be) imports every mutated module from the copy."""
    for edit in mutant.edits:
        # A migration is not imported by name: Alembic reads it from the
        # directory beside the alembic.ini that app/admin.py::migrate_database
        # finds next to itself, so app.admin must come from the copy.
        migration = edit.path.startswith("migrations/")
        module, expected = ("app.admin", tree / "app/admin.py") if migration else (module_of(edit.path), tree / edit.path)
        # Run from / so that only PYTHONPATH, not the current directory, can find the copy.
        imported = subprocess.run(
            [sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
            cwd="/", env=env, capture_output=True, text=True,
        )
        found = Path(imported.stdout.strip() or "?")
        if imported.returncode != 0 or found != expected:
            return f"{module} came from {found} ({imported.stderr.strip()[-300:]})"
        found = tree / edit.path
        if edit.replace and edit.replace not in found.read_text():
            return f"{found} does not hold the mutation"
    return None


# --- Running tests --------------------------------------------------------------


@dataclass
class Run:
    code: int | None  # None: timed out
    seconds: float
    log: Path
    summary: str


# The pytest sessions running now, each the leader of its process group:
# what an interrupted run stops before it exits (stop_sessions), after which
# no new one starts.
_sessions: set[subprocess.Popen] = set()
_stopping = threading.Event()


def pytest(tests: tuple[str, ...], tree: Path, env: dict[str, str], log: Path, timeout: float) -> Run:
    if _stopping.is_set():
        raise KeyboardInterrupt
    started = time.monotonic()
    with log.open("w") as out:
        # A session of its own, so that on a timeout the whole group (pytest and
        # the processes it started) can be stopped by its id.
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"],
            cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        _sessions.add(process)
        try:
            code: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        finally:
            _sessions.discard(process)
    # pytest -q sums up in a line such as "2 failed, 3 passed in 12.34s"
    totals = [
        line.strip("= ").split(" in ")[0]
        for line in log.read_text(errors="replace").splitlines()
        if re.fullmatch(r"=* ?\d+ \w+(, \d+ \w+)* in [\d.]+s( \(.*\))? ?=*", line.strip())
    ]
    summary = totals[-1] if totals else "no summary"
    return Run(code, time.monotonic() - started, log, summary)


@contextmanager
def stopped_on_interrupt() -> Iterator[None]:
    """On Ctrl-C, stop the sessions running now (the pool, left next, would wait for them to end by themselves)."""
    try:
        yield
    except KeyboardInterrupt:
        stop_sessions()
        raise


def stop_sessions() -> None:
    """Kill every pytest session still running, with the processes it started (Ctrl-C: in their own groups,
    they would not see it)."""
    _stopping.set()
    for process in list(_sessions):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def short(test: str) -> str:
    return test.removeprefix("tests/").replace(".py::", "::")


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- Main -----------------------------------------------------------------------


def database_url() -> tuple[str, object | None]:
    """The server to test against, and the embedded server to stop afterwards (None: leave it)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url, None
    from devtools import embedded_db

    server = embedded_db.default_server()
    started = embedded_db.start(server)
    return server.url(), server if started else None


def jobs_for(requested: int) -> int:
    """`requested` sessions at once, or as many as the tests' server has connections for (at least one)."""
    import asyncio

    from tests.conftest import CONNECTIONS_PER_WORKER, connection_room

    return max(1, min(requested, asyncio.run(connection_room()) // CONNECTIONS_PER_WORKER))


Result = tuple[Mutant, str, float, str]  # the mutant, its outcome, its seconds, what to show if not killed


class Lanes:
    """One lane per session at once, each with a block of ports of its own (devtools/processes.py::free_port).

    A session without -n walks block 0 of the ports from a place set by its
    process id, and two started one after the other are given neighbouring
    ids: each could hand out a port the other has handed out and not bound
    yet. So each lane's sessions get a block from the top, PORT_BLOCK.
    """

    def __init__(self, jobs: int) -> None:
        self.free: queue.Queue[dict[str, str]] = queue.Queue()
        blocks = processes.port_blocks()
        for lane in range(jobs):
            self.free.put({"PORT_BLOCK": str(blocks - 1 - lane)} if blocks - 1 - lane > 0 else {})

    @contextmanager
    def lane(self) -> Iterator[dict[str, str]]:
        env = self.free.get()
        try:
            yield env
        finally:
            self.free.put(env)


def try_mutant(m: Mutant, pristine: Path, work: Path, env_for, timeout: float, lanes: Lanes) -> Result:
    """Copy the pristine tree, apply `m` there, and run its tests: killed, SURVIVED, MALFORMED or ERROR."""
    tree = work / m.name
    shutil.copytree(pristine, tree, symlinks=True)
    apply(m, tree)
    with lanes.lane() as lane:
        return _run_mutant(m, tree, work, env_for(tree) | lane, timeout)


def _run_mutant(m: Mutant, tree: Path, work: Path, env: dict[str, str], timeout: float) -> Result:
    invisible = check_visible(m, tree, env)
    if invisible:
        return m, f"ERROR (not visible: {invisible})", 0.0, ""
    started = time.monotonic()
    if m.still_pass:
        guard = pytest(m.still_pass, tree, env, work / f"{m.name}.still_pass.log", timeout)
        if guard.code != 0:
            return m, "MALFORMED (a test that must still pass failed)", time.monotonic() - started, tail(guard.log)
    run = pytest(m.tests, tree, env, work / f"{m.name}.log", timeout)
    detail = ""
    if run.code == 1:
        outcome = f"killed ({run.summary})"
    elif run.code == 0:
        outcome, detail = "SURVIVED", tail(run.log, 5)
    elif run.code is None:
        outcome, detail = f"ERROR (timed out after {timeout:.0f} s)", tail(run.log)
    else:
        outcome, detail = f"ERROR (pytest exit code {run.code})", tail(run.log)
    return m, outcome, time.monotonic() - started, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="show the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS, help="seconds per pytest run")
    parser.add_argument("--jobs", type=int, default=JOBS, help="pytest sessions at once (fewer if the server "
                        "has too few connections)")
    args = parser.parse_args(argv)

    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    mutants = [m for m in MUTANTS if not args.names or m.name in args.names]

    if args.list:
        for m in mutants:
            print(f"{m.name}: breaks \"{m.rule}\"\n  changes {where(m)}")
            for test in m.tests:
                print(f"  caught by {test}")
            for test in m.still_pass:
                print(f"  still passing {test}")
        return 0

    stale = {m.name: stale_edits(m) for m in mutants}
    for name, problems in stale.items():
        for problem in problems:
            print(f"mutant {name} cannot be applied: {problem}", file=sys.stderr)

    url, embedded = database_url()
    work = Path(tempfile.mkdtemp(prefix="mutants-"))
    results: list[Result] = []
    try:
        pristine = work / "pristine"
        copy_tree(pristine)

        def env_for(tree: Path) -> dict[str, str]:
            return {**os.environ, "PYTHONPATH": str(tree), "DATABASE_URL": url}

        jobs = jobs_for(args.jobs)
        lanes = Lanes(jobs)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in (*m.still_pass, *m.tests)))
            # Never more parts than test ids: pytest given none would run the whole suite.
            parts = min(jobs, len(tests))
            print(f"baseline: {len(tests)} test ids on the unmutated copy, in {parts} session(s) at once ...",
                  flush=True)
            started = time.monotonic()

            def baseline(part: int) -> Run:
                with lanes.lane() as lane:
                    return pytest(tests[part::parts], pristine, env_for(pristine) | lane,
                                  work / f"baseline.{part}.log", args.timeout)

            with ThreadPoolExecutor(parts) as pool, stopped_on_interrupt():
                runs = list(pool.map(baseline, range(parts)))
            failed = [run for run in runs if run.code != 0]
            print(f"baseline: {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f} s", flush=True)
            if failed:
                print(tail(failed[0].log), file=sys.stderr)
                print("the tests fail without any mutant: a kill would mean nothing; fix them first", file=sys.stderr)
                return 1

        by_name: dict[str, Result] = {
            m.name: (m, "STALE (source text not found)", 0.0, "") for m in mutants if stale[m.name]
        }
        with ThreadPoolExecutor(jobs) as pool, stopped_on_interrupt():
            running = [pool.submit(try_mutant, m, pristine, work, env_for, args.timeout, lanes)
                       for m in mutants if not stale[m.name]]
            for future in as_completed(running):
                m, outcome, seconds, detail = future.result()
                by_name[m.name] = (m, outcome, seconds, detail)
                print(f"{m.name}: {outcome} in {seconds:.0f} s", flush=True)
        results = [by_name[m.name] for m in mutants]  # the table in the list's order, whatever finished first
    finally:
        if embedded is not None:
            from devtools import embedded_db

            embedded_db.stop(embedded)
        if args.keep:
            print(f"copies and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(table(results))
    for m, outcome, _, detail in results:
        if not outcome.startswith("killed") and detail:
            print(f"\n--- {m.name}: {outcome}\n{detail}")
    bad = [m.name for m, outcome, _, _ in results if not outcome.startswith("killed")]
    if bad:
        print(f"\nnot killed: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"\nall {len(results)} mutants killed")
    return 0


def table(results: list[Result]) -> str:
    """One row per mutant (name, result, seconds, where it changes the source), then its rule and tests."""
    widths = (max(len(m.name) for m, *_ in results), max(len(outcome) for _, outcome, *_ in results))
    lines = [f"{'mutant':<{widths[0]}}  {'result':<{widths[1]}}  {'seconds':>7}  file:line it changes"]
    for m, outcome, seconds, _ in results:
        lines.append(f"{m.name:<{widths[0]}}  {outcome:<{widths[1]}}  {seconds:>7.0f}  {where(m)}")
        indent = " " * (widths[0] + 2)
        lines.append(f"{indent}rule it breaks: {m.rule}")
        for test in m.still_pass:
            lines.append(f"{indent}must still pass: {short(test)}")
        for test in m.tests:
            lines.append(f"{indent}tests run: {short(test)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
