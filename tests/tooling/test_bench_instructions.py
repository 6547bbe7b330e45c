"""bench/instructions.py's arithmetic, its windows and its naming of statements; no valgrind, no database."""

from __future__ import annotations

import re
import weakref

import greenlet
import pytest
from sqlalchemy.sql.elements import TextClause

from app.machine.statements import Statement
from app.payments import phases
from bench.instructions import (
    COMMAND,
    NAIVE,
    PAYMENTS,
    PHASED,
    REPLAYS,
    SETTINGS,
    UNWATCHED,
    Count,
    Instructions,
    NoFigure,
    Window,
    _count_start,
    agreed,
    callgrind_total,
    known_phases,
    per_unit,
    phase_of,
    report,
    spread,
    window_total,
    windows,
)
from naive_twin import app as naive

# The head and tail of a real callgrind output file (bench/results/callgrind/), cut short: `summary:` is
# written before the per-function costs, `totals:` after them, and valgrind's "I refs" is the totals.
CALLGRIND_OUT = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 13637
cmd:  /work/.venv/bin/python /work/.venv/bin/payments api --port 41227
part: 1

desc: I1 cache:
desc: Timerange: Basic block 0 - 912442210
desc: Trigger: Program termination

positions: line
events: Ir
summary: 4704060322


ob=(1) /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
fl=(1) ???
fn=(1) 0x000000000001fe10
0 12
totals: 4704061772
"""


def test_the_total_is_the_totals_line_which_valgrind_prints_as_i_refs():
    assert callgrind_total(CALLGRIND_OUT) == 4704061772


def test_without_a_totals_line_the_summary_is_the_total():
    assert callgrind_total(CALLGRIND_OUT.replace("totals: 4704061772\n", "")) == 4704060322


@pytest.mark.parametrize("text", ["", "events: Ir\n", "events: Ir\nsummary: 0\n", "# totals: 12\n"])
def test_an_output_with_no_count_is_no_figure_not_a_zero(text):
    with pytest.raises(NoFigure):
        callgrind_total(text)


# One window's dump (out.1, out.2, ...): written on leaving the end marker, not at the program's end.
WINDOW_DUMP = CALLGRIND_OUT.replace("desc: Trigger: Program termination",
                                    "desc: Trigger: --dump-after=gc_get_freeze_count")


def test_a_window_is_counted_by_the_summary_of_the_dump_its_end_marker_wrote():
    # Not its totals: the first dump's hold costs from before callgrind first zeroed its counts.
    assert window_total(WINDOW_DUMP) == 4704060322


@pytest.mark.parametrize("text", [WINDOW_DUMP.replace("summary: 4704060322\n", ""),
                                  WINDOW_DUMP.replace("summary: 4704060322", "summary: 0")])
def test_a_window_without_a_count_is_no_figure(text):
    with pytest.raises(NoFigure):
        window_total(text)


def test_a_dump_at_the_programs_end_is_not_a_window_it_counts_start_up_too():
    with pytest.raises(NoFigure):
        window_total(CALLGRIND_OUT)


def test_the_phased_service_counts_payments_and_replays_the_twin_payments_only():
    assert windows(PHASED, 10, 110, replays=True) == [
        Window(PAYMENTS, 10), Window(PAYMENTS, 110), Window(REPLAYS, 10), Window(REPLAYS, 110)]
    assert windows(PHASED, 10, 110, replays=False) == [Window(PAYMENTS, 10), Window(PAYMENTS, 110)]
    assert windows(NAIVE, 10, 110, replays=True) == [Window(PAYMENTS, 10), Window(PAYMENTS, 110)]


def test_the_safe_service_unwatched_counts_replays_too_and_runs_with_metrics_and_logs_off():
    # What watching costs is phased ÷ unwatched: the same windows, the same app, only the settings apart.
    assert windows(UNWATCHED, 10, 110, replays=True) == windows(PHASED, 10, 110, replays=True)
    assert COMMAND[UNWATCHED] == COMMAND[PHASED] == "api"
    assert SETTINGS[UNWATCHED]["METRICS_ENABLED"] == "false" and SETTINGS[PHASED]["METRICS_ENABLED"] == "true"


def test_watching_is_reported_as_phased_over_unwatched_per_payment_and_per_replay(capsys):
    figures = [Instructions(PHASED, r, 1_020.0, 105.0) for r in (1, 2)] + \
              [Instructions(UNWATCHED, r, 1_000.0, 100.0) for r in (1, 2)]
    report(figures, [PHASED, UNWATCHED], 10, 110, 0.01)
    out = capsys.readouterr().out
    assert "phased ÷ unwatched per payment = 1.0200" in out
    assert "phased ÷ unwatched per replay = 1.0500" in out
    assert "phased ÷ naive" not in out


def test_repeats_that_agree_give_their_mean():
    assert agreed("phased per payment", [1000.0, 1009.0], 0.01) == pytest.approx(1004.5)


@pytest.mark.parametrize("figures", [[1000.0, 1011.0], [1000.0], [2000.0, 1000.0]])
def test_repeats_that_disagree_or_a_single_one_give_no_figure(figures):
    with pytest.raises(NoFigure):
        agreed("phased per payment", figures, 0.01)


def test_per_payment_is_the_difference_of_two_runs_over_the_difference_in_payments():
    # 1000 in both windows besides their payments; 50 per payment.
    assert per_unit(Count(20, 0, 1000 + 20 * 50), Count(60, 0, 1000 + 60 * 50)) == 50


def test_per_replay_is_the_difference_of_two_runs_over_the_replays_added():
    assert per_unit(Count(20, 0, 2000), Count(20, 40, 2000 + 40 * 7)) == 7


@pytest.mark.parametrize("fewer, more", [
    (Count(20, 0, 1000), Count(20, 0, 2000)),  # the same requests: nothing to divide by
    (Count(20, 0, 1000), Count(60, 40, 9000)),  # payments and replays both added: which one cost it?
    (Count(60, 0, 9000), Count(20, 40, 9900)),  # fewer payments, more replays
    (Count(20, 0, 5000), Count(60, 0, 5000)),  # no more instructions for more payments: a broken count
    (Count(20, 0, 5000), Count(60, 0, 4000)),
])
def test_runs_that_do_not_differ_in_one_kind_of_request_alone_give_no_figure(fewer, more):
    with pytest.raises(NoFigure):
        per_unit(fewer, more)


def test_spread_is_relative_to_the_smallest():
    assert spread([100.0, 101.0]) == pytest.approx(0.01)
    assert spread([101.0, 100.0, 100.5]) == pytest.approx(0.01)


def as_the_server_shows_it(sql: str) -> str:
    """A statement as pg_stat_statements shows it: SQLAlchemy's `:name`s as asyncpg's `$n` (one per name),
    and a literal the way pg_stat_statements may replace it, by `$n` too."""
    numbers: dict[str, int] = {}
    shown = re.sub(r"(?<![:\w]):(\w+)", lambda m: f"${numbers.setdefault(m.group(1), len(numbers) + 1)}", sql)
    return shown.replace("'succeeded'", f"${len(numbers) + 1}", 1)


@pytest.mark.parametrize("name", ["HANDLER1", "CHARGE_CAPTURED", "CHARGE_DECLINED", "PAYOUT_SENT"])
def test_each_phase_statement_is_named_by_its_phase(name):
    statement = getattr(phases, name)
    assert phase_of(as_the_server_shows_it(statement.sql), known_phases()) == name


def test_the_naive_twins_statements_are_named_as_the_twins():
    assert phase_of(as_the_server_shows_it(naive._PAID.text), known_phases()) == "naive twin PAID"
    assert phase_of(as_the_server_shows_it(naive._INSERT.text), known_phases()) == "naive twin INSERT"


def test_a_phase_is_matched_by_its_whole_text_not_by_a_part_of_it():
    # HANDLER1 with one more column written is some other statement, not HANDLER1.
    changed = phases.HANDLER1.sql.replace("beneficiary_iban", "beneficiary_iban, beneficiary_bic", 1)
    assert changed != phases.HANDLER1.sql
    assert phase_of(as_the_server_shows_it(changed), known_phases()) != "HANDLER1"


def test_no_two_phase_statements_read_alike_once_normalised():
    # Two that did would be named by whichever came last: every statement must keep a name of its own.
    from app.payments import returns
    from app.payments.refunds import phases as refund_phases

    statements = [v for m in (phases, returns, refund_phases) for v in vars(m).values() if isinstance(v, Statement)]
    statements += [v for v in vars(naive).values() if isinstance(v, TextClause)]
    assert len(known_phases()) == len(statements)


@pytest.mark.parametrize("query, name", [
    ("SELECT c.id AS caller_id, k.client_id, k.key FROM client c LEFT JOIN idempotency_key k ON k.key = $1",
     "the caller's and the key's lookup"),
    ('SELECT 1 FROM ONLY "public"."payment" x WHERE "id" OPERATOR(pg_catalog.=) $1 FOR KEY SHARE OF x',
     "foreign key: the payment row KEY SHARE"),
    ("SELECT pg_advisory_xact_lock(hashtextextended(p_client_id::text || '/' || p_key, 0))",
     "the claim: the key's advisory lock"),
    ("INSERT INTO idempotency_key (client_id, key, stored_on) VALUES (p_client_id, p_key, key_table_day())",
     "the claim: the key row's insert"),
    ("SELECT 1 FROM idempotency_key WHERE client_id = p_client_id AND key = p_key", "the claim: is the key taken?"),
    ("SELECT id FROM client WHERE api_key_hash = $1", "the caller's lookup (API key)"),
    ("SELECT now() - pg_postmaster_start_time()", "the driver or pool (catalogue)"),
    ("VACUUM payment", "other"),
])
def test_other_statements_are_named_by_what_their_text_says(query, name):
    assert phase_of(query, known_phases()) == name


def test_the_dispatchers_statements_are_named_however_they_were_sent():
    # The cursor's read goes to asyncpg compiled to $n (app/db/driver.py); a retry's claim through SQLAlchemy.
    from app.outbox import delivery
    from bench.webhook_instructions import dispatcher_statements

    names = dispatcher_statements()
    assert phase_of(delivery._TAKE_POSITIONAL.sql, names) == "delivery._TAKE"
    assert phase_of(delivery._MOVE_POSITIONAL.sql, names) == "delivery._MOVE"
    # As the server showed it in a run: its `lease_token = NULL` as a parameter of its own.
    shown = delivery._MOVE_POSITIONAL.sql.replace("lease_token = NULL", "lease_token = $15", 1)
    assert shown != delivery._MOVE_POSITIONAL.sql and phase_of(shown, names) == "delivery._MOVE"
    assert phase_of(as_the_server_shows_it(delivery._CLAIM.text), names) == "delivery._CLAIM"
    # As PostgreSQL 18 keeps it: from its first word, so without the comment it opens with, whose
    # apostrophe ("the cursor's row") must not pair with one in a later comment as a literal.
    opening, _, rest = delivery._TAKE_POSITIONAL.sql.lstrip().partition("WITH")
    assert opening.startswith("--") and "'" in opening
    assert phase_of("WITH" + rest, names) == "delivery._TAKE"
    # No two of its statements read alike once normalised, so none loses its name to another.
    texts = [v for v in vars(delivery).values() if isinstance(v, TextClause)]
    assert len(names) == len(texts) + 1  # and this bench's own poll


def test_the_greenlet_count_counts_each_greenlet_once_as_it_starts_and_never_the_main_one():
    started, seen = [0], weakref.WeakSet()

    def hops_back_and_forth() -> None:
        main.switch()  # back to the main greenlet, then resumed: the same greenlet, not a new one
        main.switch()

    main = greenlet.getcurrent()
    previous = greenlet.settrace(lambda event, args: _count_start(started, seen, event, args))
    try:
        for _ in range(3):
            worker = greenlet.greenlet(hops_back_and_forth)
            while not worker.dead:
                worker.switch()
    finally:
        greenlet.settrace(previous)
    assert started[0] == 3
