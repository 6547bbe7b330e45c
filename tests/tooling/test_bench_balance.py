"""The bench's measure of how evenly `payments api --workers N` shares its CPU between its worker processes."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Any

from aiohttp import web

from bench.costs import CpuMark, CpuMeter
from bench.load import PATH, Load, RunResult, _Exhausted
from bench.report import balance, served, summarize, worst_balance


def test_the_split_gives_each_workers_share_busiest_first_and_the_busiest_over_the_idlest():
    even = balance([3.1, 2.9])
    skewed = balance([0.37, 6.74])

    assert even == {"percent": [51.7, 48.3], "max_over_min": 3.1 / 2.9}
    assert skewed is not None and skewed["percent"] == [94.8, 5.2]
    assert round(skewed["max_over_min"], 1) == 18.2


def test_a_worker_that_did_nothing_is_infinitely_uneven_and_one_process_or_no_cpu_is_no_figure():
    idle = balance([4.0, 0.0])

    assert idle is not None and idle["percent"] == [100.0, 0.0] and math.isinf(idle["max_over_min"])
    assert balance([4.0]) is None
    assert balance([0.0, 0.0]) is None


def test_the_split_counts_only_the_workers_an_idle_one_too_and_not_the_supervisor_or_another_process():
    supervisor, tracker, busy, idle = 10, 11, 12, 13
    before = CpuMark(seconds={"API": {supervisor: 1.0, tracker: 0.1, busy: 2.0, idle: 0.5}})
    after = CpuMark(seconds={"API": {supervisor: 1.2, tracker: 0.1, busy: 8.0, idle: 0.5}})

    shares = CpuMeter.workers(before, after, "API", {busy: set(), idle: set()}, Counter())
    assert [w.cpu_seconds for w in shares] == [6.0, 0.0]


def test_each_worker_is_credited_with_the_answers_on_the_connections_it_holds_and_its_own_wait_for_a_cpu():
    first, second = 12, 13
    before = CpuMark(seconds={"API": {first: 2.0, second: 1.0}}, waited={"API": {first: 0.5, second: 0.5}},
                     preempted={"API": {first: 10, second: 10}})
    after = CpuMark(seconds={"API": {first: 5.0, second: 7.0}}, waited={"API": {first: 2.5, second: 0.75}},
                    preempted={"API": {first: 40, second: 15}})
    before.in_kernel = {"API": {first: 0.25, second: 0.5}}
    after.in_kernel = {"API": {first: 1.0, second: 1.5}}
    held = {first: {50001, 50002}, second: {50003}}
    # 50004's connection was closed during the run: its answers are no one's.
    answered = Counter({50001: 100, 50002: 200, 50003: 500, 50004: 7, None: 1})

    shares = CpuMeter.workers(before, after, "API", held, answered)

    assert [w.to_json() for w in shares] == [
        {"cpu_seconds": 6.0, "requests": 500, "connections": 1, "waited_seconds": 0.25, "preemptions": 5,
         "kernel_seconds": 1.0, "pid": second},
        {"cpu_seconds": 3.0, "requests": 300, "connections": 2, "waited_seconds": 2.0, "preemptions": 30,
         "kernel_seconds": 0.75, "pid": first}]


def test_the_load_counts_each_answer_by_the_clients_port_the_server_saw_it_come_from():
    served: Counter[int] = Counter()
    # The first request is held until a second is in flight beside it, so
    # that the clients cannot all take turns on one connection (a quick
    # server and a busy machine once let them): two ports are always seen.
    in_flight = 0
    two_at_once = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        nonlocal in_flight
        in_flight += 1
        if in_flight >= 2:
            two_at_once.set()
        try:
            await asyncio.wait_for(two_at_once.wait(), 5.0)
        finally:
            in_flight -= 1
        served[request.transport.get_extra_info("peername")[1]] += 1
        return web.json_response({}, status=201)

    async def run() -> RunResult:
        app = web.Application()
        app.router.add_post(PATH, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        sent = iter(range(60))
        try:
            async with Load(f"http://127.0.0.1:{port}", "key", concurrency=3) as load:

                async def one(result: RunResult) -> None:
                    if next(sent, None) is None:
                        raise _Exhausted
                    await load.new_payment(result)

                return await load.run(one, 30.0)
        finally:
            await runner.cleanup()

    result = asyncio.run(asyncio.wait_for(run(), 10.0))

    assert result.succeeded == 60 and sum(served.values()) == 60
    assert dict(result.answered) == dict(served) and len(served) >= 2


def test_the_worst_round_at_two_workers_is_the_target_row_and_one_worker_has_none():
    runs = [_run("phased", 2, 1, [5.0, 4.5]), _run("naive", 2, 1, [6.0, 4.0]), _run("replays", 2, 1, [3.0, 2.9]),
            _run("phased", 1, 1, [9.0])]
    blocks = {b["workers"]: b for b in summarize(_results(runs))["blocks"]}

    target = blocks[2]["targets"][-1]
    assert target["target"] == "API workers' CPU: max ÷ min, worst round"
    assert target["value"] == 1.5 and target["met"] is False and target["goal"] == "<= 1.2×"
    assert blocks[2]["api_balance_worst"] | {"max_over_min": None} == {
        "kind": "naive", "round": 1, "percent": [60.0, 40.0], "max_over_min": None, "connections": []}
    assert blocks[2]["phased"]["api_split_percent"] == ["53/47 (1.11)"]
    assert not any(t["target"].startswith("API workers'") for t in blocks[1]["targets"])


def test_rounds_all_within_the_bound_meet_the_target():
    runs = [_run("phased", 2, 1, [5.0, 4.5]), _run("naive", 2, 1, [4.2, 4.0])]

    target = summarize(_results(runs))["blocks"][0]["targets"][-1]
    assert target["met"] is True and round(target["value"], 3) == round(5.0 / 4.5, 3)


def _run(kind: str, workers: int, round_: int, split: list[float]) -> dict[str, Any]:
    return {
        "kind": kind, "workers": workers, "round": round_,
        "run": {"per_second": 100.0, "succeeded": 400, "requests": 400, "latency_ms": {"p50": 10.0, "p99": 20.0}},
        "wal": {"transactions": 1200, "by_tables": {"a+b": 1200}, "wal_bytes": 0, "fpi_bytes": 0,
                "wal_bytes_all": 0, "operations": 400},
        "xact_commit": {"delta": 800, "operations": 400},
        "cpu_seconds": {"API": sum(split)}, "cpu_seconds_api_by_process": split, "machine_busy_percent": 50.0,
        "exactly_once": {"pass": True},
    }


def _results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    workers = sorted({r["workers"] for r in runs})
    return {"parameters": {"workers": workers}, "runs": runs, "ceiling": {},
            "pooled_latency_ms": {str(w): {r["kind"]: r["run"]["latency_ms"] for r in runs if r["workers"] == w}
                                  for w in workers}}


def test_the_least_even_round_says_whether_its_busiest_worker_served_more_or_spent_more_an_answer():
    served_more = _run("replays", 2, 2, [3.34, 2.36]) | {
        "api_workers": [_worker(3.34, 590, waited=0.5), _worker(2.36, 410, waited=1.9)], "api_answers_unplaced": 3}
    spent_more = _run("replays", 2, 3, [3.0, 2.0]) | {
        "api_workers": [_worker(3.0, 500, waited=1.0), _worker(2.0, 500, waited=1.0)], "api_answers_unplaced": 0}

    worst = worst_balance([served_more, _run("replays", 2, 1, [3.0, 2.9])])
    assert worst is not None and worst["answers_percent"] == [59.0, 41.0]
    assert round(worst["cpu_per_answer_ratio"], 3) == round((3.34 / 590) / (2.36 / 410), 3)
    assert worst["waited_seconds"] == [0.5, 1.9] and worst["answers_unplaced"] == 3
    assert served(spent_more["api_workers"], 0)["cpu_per_answer_ratio"] == 1.5
    assert summarize(_results([spent_more]))["blocks"][0]["replays"]["api_split_percent"] == ["60/40 (1.50; answers 50/50)"]


def test_a_run_from_before_answers_were_counted_or_with_a_worker_that_answered_nothing_shows_no_answers():
    assert served([], None) == {}
    assert served([_worker(3.0, 10), _worker(0.1, 0)], 0) == {}
    assert "answers_percent" not in (worst_balance([_run("naive", 2, 1, [6.0, 4.0])]) or {})


def _worker(cpu: float, answers: int, waited: float = 0.0) -> dict[str, Any]:
    return {"cpu_seconds": cpu, "requests": answers, "connections": 16, "waited_seconds": waited, "preemptions": 0}
