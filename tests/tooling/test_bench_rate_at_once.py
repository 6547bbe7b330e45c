"""How bench/rate_at_once.py charges each side of a round: the worker to the safe service, sessions and fakes by
owner; which services it puts on its two sides; and how each side's calls arrived at its fake PSP, read from the
fake's request log on a real server."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from bench.load import RunResult
from bench.rate_at_once import KEY_LENGTHS, arrivals, round_figures, services_of, summary
from bench.sessions import Mark
from fake_rails.common import REQUEST_LOG_DDL


def _ran(payments: int, seconds: float) -> RunResult:
    return RunResult(latencies=[0.1] * payments, elapsed=seconds)


def _marks(owned: bool) -> tuple[Mark, Mark]:
    owner = {10: "phased", 11: "naive", 12: "worker"} if owned else {}
    before = Mark(processes={"phased": {1: 1.0}, "naive": {2: 1.0}, "worker": {3: 1.0}},
                  sessions={10: 1.0, 11: 1.0, 12: 1.0}, owner=owner)
    after = Mark(processes={"phased": {1: 1.5}, "naive": {2: 2.0}, "worker": {3: 1.125}},
                 sessions={10: 1.25, 11: 1.125, 12: 1.125}, owner=owner)
    return before, after


def test_the_worker_and_its_sessions_are_the_safe_services_and_each_side_is_charged_its_own_sessions():
    figures = round_figures(*_marks(owned=True), {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    phased, naive = figures["phased"], figures["naive"]
    assert (phased["api_ms"], phased["sessions_ms"], phased["worker_ms"]) == (2.0, 1.0, 1.0)
    assert phased["service_ms"] == 4.0
    assert (naive["api_ms"], naive["sessions_ms"], naive["service_ms"]) == (5.0, 0.625, 5.625)
    assert "worker_ms" not in naive
    assert figures["rate_ratio"] == 1.25
    assert figures["cpu_ratio"] == round(4.0 / 5.625, 4)
    assert figures["db_ratio"] == 1.6


def test_sessions_that_cannot_be_told_apart_give_no_database_figure_not_a_guess():
    figures = round_figures(*_marks(owned=False), {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    assert figures["phased"]["sessions_ms"] is None and figures["naive"]["service_ms"] is None
    assert figures["cpu_ratio"] is None and figures["db_ratio"] is None
    assert figures["rate_ratio"] == 1.25, "the rate needs no session"


def test_the_summary_is_the_median_of_the_rounds_ratios():
    rounds = [round_figures(*_marks(owned=True), {"phased": _ran(p, 10.0), "naive": _ran(200, 10.0)})
              for p in (180, 250, 220)]

    figures = summary(rounds)

    assert figures["rate_ratio"] == 1.1
    assert figures["medians"]["phased"]["per_second"] == 22.0
    assert "worker_ms" not in figures["medians"]["naive"]


def test_each_sides_fakes_are_charged_to_it_with_their_sessions_and_added_to_its_whole_work():
    before, after = _marks(owned=True)
    # The phased side's fakes spend 0.5 s of CPU (PSP 0.25 + a session 0.125, rail 0.125),
    # the twin's 0.25 s (PSP 0.125 + a session 0.0625, rail 0.0625).
    for side, psp, session, rail, pid in (("phased", 0.25, 0.125, 0.125, 20), ("naive", 0.125, 0.0625, 0.0625, 30)):
        before.processes |= {f"{side} psp": {pid: 1.0}, f"{side} rail": {pid + 1: 1.0}}
        after.processes |= {f"{side} psp": {pid: 1.0 + psp}, f"{side} rail": {pid + 1: 1.0 + rail}}
        before.sessions[pid + 100], after.sessions[pid + 100] = 1.0, 1.0 + session
        before.owner[pid + 100] = after.owner[pid + 100] = f"{side} psp"
        # Woken 500 times for either side's payments, and a rail process new since the first mark 250 times.
        before.woken |= {f"{side} psp": {pid: 100}}
        after.woken |= {f"{side} psp": {pid: 600}, f"{side} rail": {pid + 1: 250}}

    figures = round_figures(before, after, {"phased": _ran(250, 10.0), "naive": _ran(125, 10.0)})

    phased, naive = figures["phased"], figures["naive"]
    assert (phased["psp_ms"], phased["rail_ms"], phased["fakes_ms"]) == (1.5, 0.5, 2.0)
    assert (naive["psp_ms"], naive["rail_ms"], naive["fakes_ms"]) == (1.5, 0.5, 2.0)
    assert figures["fakes_ratio"] == 1.0, "the same work a payment, though the twin's fakes served half as many"
    assert phased["whole_ms"] == phased["service_ms"] + 2.0 and naive["whole_ms"] == naive["service_ms"] + 2.0
    assert figures["whole_ratio"] == round(phased["whole_ms"] / naive["whole_ms"], 4)
    assert phased["sessions_ms"] == 1.0, "a fake's session is not the service's"
    assert (phased["psp_wakeups"], naive["psp_wakeups"]) == (2.0, 4.0)
    assert (phased["rail_wakeups"], naive["rail_wakeups"]) == (1.0, 2.0)


def test_a_round_without_each_sides_fakes_charges_none():
    figures = round_figures(*_marks(owned=True), {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    assert "fakes_ms" not in figures["phased"] and figures["whole_ratio"] is None
    assert summary([figures])["whole_ratio"] is None


def test_a_round_with_no_worker_charges_none_to_the_phased_side():
    # A control (--at-once phased,phased) charges its worker to neither side.
    before, after = _marks(owned=True)
    for mark in (before, after):
        del mark.processes["worker"]
        mark.owner.pop(12, None)  # the worker's session

    figures = round_figures(before, after, {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    assert "worker_ms" not in figures["phased"], "no worker was there to charge"
    assert figures["phased"]["service_ms"] == 3.0, "the API's 2.0 and its sessions' 1.0, nothing more"


def test_the_step_takes_the_reading_or_a_control_with_one_service_on_both_sides():
    assert services_of("phased,naive") == ("phased", "naive")
    assert services_of("naive, naive") == ("naive", "naive")
    assert services_of("phased,phased") == ("phased", "phased")
    # The twin in the column named phased would read as the other way round.
    for wrong in ("naive,phased", "phased", "phased,naive,naive", "phased,webhooks", ""):
        with pytest.raises(ValueError, match="--at-once takes"):
            services_of(wrong)


def test_each_sides_calls_are_read_apart_by_their_keys_within_the_round_and_a_control_has_none(scratch: str):
    start = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    ms = timedelta(milliseconds=1)
    phased = [(start + i * 10 * ms, "POST", "/v1/charges", "a" * 64) for i in range(4)]  # 10 ms apart
    naive = [(start + t * ms, "POST", "/v1/charges", f"{i:036d}") for i, t in enumerate((0.0, 0.1, 0.2, 30.0))]
    others = [
        (start + 5 * ms, "GET", "/v1/charges", "b" * 64),  # a probe is not a call that arrives to be charged
        (start + 15 * ms, "POST", "/v1/refunds", "c" * 64),  # nor a refund
        (start + timedelta(seconds=100), "POST", "/v1/charges", "d" * 64),  # after the round
    ]

    async def go() -> tuple[dict, dict]:
        conn = await asyncpg.connect(scratch)  # holding the fake PSP's request log, and nothing else
        try:
            await conn.execute("CREATE SCHEMA fake_psp;" + REQUEST_LOG_DDL.format(schema="fake_psp"))
            await conn.executemany("INSERT INTO fake_psp.request (at, method, path, idempotency_key) "
                                   "VALUES ($1, $2, $3, $4)", phased + naive + others)
            until = start + timedelta(seconds=10)
            return await arrivals(conn, start, until, KEY_LENGTHS), await arrivals(conn, start, until, None)
        finally:
            await conn.close()

    read, control = asyncio.run(go())

    assert read["phased"] == {"psp_gap_ms": 10.0, "psp_bunched": 0.0}
    # Gaps of 0.1, 0.1 and 29.8 ms: two of the three within 0.5 ms of the call before.
    assert read["naive"] == {"psp_gap_ms": 0.1, "psp_bunched": round(2 / 3, 3)}
    assert control == {}, "one service on both sides: its calls cannot be told apart"
