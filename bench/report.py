"""The bench's figures, summarised per worker count, checked against the targets, printed.

Everything here reads the results dictionary that is also written as JSON,
so a saved result can be printed again (`python -m bench.report FILE`).

Rates are the mean over rounds, with the min-max over rounds beside them: the
run-to-run spread, which says how much a difference between two figures can
be trusted (docs/reference/performance.md: separate runs drift apart; the
variants here are measured in alternation, which is why their ratio is the
figure to quote). Latency percentiles are over all rounds' requests pooled.
Costs per payment are totals over all rounds divided by all payments.
"""

from __future__ import annotations

import json
import statistics
import sys
from statistics import mean, median
from typing import Any

from rich.table import Table

from bench import rate_at_once
from bench.costs import LOAD_GENERATOR, MACHINE, OTHERS, PG_PARTS, WORKERS_OWN
from bench.system import SERVICE_DATABASE
from bench.system import console

KINDS = ("phased", "naive")
# The phased service with its metrics and logs off, and the replays of each.
WATCHING = ("unwatched", "replays", "replays-unwatched")
# A partial refund of each of the phased rounds' payments, after every other step.
REFUNDS = "refunds"
TARGETS = {
    # The median of the rounds' own ratios: each round runs both, one just
    # after the other, so a burst of other work weighs on one round, not on
    # the verdict.
    "rate": ("payments/s: phased ÷ naive, median of the rounds", ">=", 1.0, "×"),
    # The service database's backends: the part of PostgreSQL's CPU that is
    # the service's own statements, not the fakes'.
    "db_cpu": ("service DB backends' CPU per payment: phased ÷ naive", "<=", 1.0, "×"),
    "replays": ("replays/s ÷ new payments/s", ">=", 10.0, "×"),
    "writes": ("writing transactions per payment", "==", 3.0, ""),
    # The claim (key row, reservation, refund) and the PSP's answer recorded.
    "refund_writes": ("writing transactions per refund", "==", 2.0, ""),
    "p99": ("p99 latency: phased ÷ naive", "<=", 2.0, "×"),
    # New payments' watching, judged by the rounds one after the other in a
    # result from before 2026-12-06 (night); since then as the replays are:
    # watched and unwatched at once, over several pairs of APIs.
    "watching": ("payments/s: metrics and logs on ÷ off", ">=", 0.95, "×"),
    "watching_new": ("new payments/s: metrics and logs on ÷ off, at once, median of the pairs", ">=", 0.95, "×"),
    # Judged side by side on one CPU (bench/watching.py): the replay runs one
    # after the other drift by more than the 5% this allows; and over several
    # pairs of APIs, since one pair carries its own luck in every round.
    "watching_replays": ("replays/s: metrics and logs on ÷ off, at once on one CPU, median of the pairs", ">=",
                         0.95, "×"),
    # Judged side by side too (bench/outbox.py): the service's own CPU, the
    # fake merchant's left out, and both sides at the same moments.
    "outbox": ("the service's CPU per new payment: with webhooks ÷ without, at once", "<=", 1.05, "×"),
    # Of every round at 2 or more workers per API: the busiest worker
    # process's CPU ÷ the idlest one's (app/fastpath/reuse_port.py).
    "balance": ("API workers' CPU: max ÷ min, worst round", "<=", 1.2, "×"),
    # The batch round (bench/batches.py): one consumer process against one API process, at the same moments.
    "batch": ("batch rows/s ÷ HTTP new payments/s, at the same moments", ">=", 0.9, "×"),
}


DB_BACKENDS = PG_PARTS[SERVICE_DATABASE]  # the service database's backends, in the CPU table
# The processes whose wake-ups, preemptions and kernel's CPU per payment the table shows: the same fakes serve both
# services, so a difference there is in how the calls reach them or the CPU they share (bench/costs.py), not in
# what they do.
COUNTED_APART = ("API", "fake PSP", "fake rail")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _per(total: float | None, n: int, scale: float = 1.0) -> float | None:
    return None if total is None or not n else total * scale / n


def workers_own_writes(by_tables: dict[str, float]) -> float:
    """Of the writing transactions by the tables each wrote, those that wrote only the workers' own (WORKERS_OWN)."""
    return sum(count for tables, count in by_tables.items() if set(tables.split("+")) <= WORKERS_OWN)


def _images_by_relation(walled: list[dict[str, Any]], operations: int) -> dict[str, float]:
    """Page-image bytes per operation, by the relation each image is of, largest first."""
    total: dict[str, float] = {}
    for w in walled:
        for relation, size in w.get("fpi_by_relation", {}).items():  # absent from runs before it was counted
            total[relation] = total.get(relation, 0) + size
    return {r: round(b / operations, 1) for r, b in sorted(total.items(), key=lambda kv: -kv[1])} if operations else {}


def _largest_images(kind: dict[str, Any] | None) -> str:
    """The three relations whose page images took the most WAL per payment, one per line."""
    largest = list((kind or {}).get("fpi_bytes_by_relation", {}).items())[:3]
    return "\n".join(f"{relation} {fmt(size, 0)}" for relation, size in largest) or "-"


def summarize_kind(runs: list[dict[str, Any]], latency: dict[str, Any]) -> dict[str, Any]:
    """One variant (or the replays) at one worker count, over its rounds."""
    rates = [r["run"]["per_second"] for r in runs]
    n = sum(r["run"]["succeeded"] for r in runs)
    walled = [r["wal"] for r in runs if "n/a" not in r["wal"]]
    by_tables: dict[str, float] = {}
    for w in walled:
        for tables, count in w["by_tables"].items():
            by_tables[tables] = by_tables.get(tables, 0) + count
    wal_n = sum(w["operations"] for w in walled)
    workers_own = workers_own_writes(by_tables)
    xact = [r["xact_commit"] for r in runs if r["xact_commit"]["delta"] is not None]
    cpu: dict[str, float] = {}
    # Counts by process of ours, which results from before the bench recorded them lack.
    counted: dict[str, dict[str, float]] = {"wakeups": {}, "preemptions": {}, "cpu_seconds_in_kernel": {}}
    for r in runs:
        for role, seconds in r["cpu_seconds"].items():
            cpu[role] = cpu.get(role, 0.0) + seconds
        for key, sums in counted.items():
            for role, count in r.get(key, {}).items():
                sums[role] = sums.get(role, 0) + count
    complete = len(walled) == len(runs)
    return {
        "rounds": len(runs),
        "per_second": {"mean": mean(rates), "min": min(rates), "max": max(rates), "per_round": rates},
        "succeeded": n,
        "not_201": sum(r["run"]["requests"] - r["run"]["succeeded"] for r in runs),
        "latency_ms": latency,
        # The payment's (or the refund's) own: the workers' bookkeeping is counted apart (costs.WORKERS_OWN).
        "writing_txns": _per(sum(w["transactions"] for w in walled) - workers_own, wal_n) if complete else None,
        "workers_writing_txns": _per(workers_own, wal_n) if complete else None,
        "writing_txns_n/a": None if complete else next(r["wal"]["n/a"] for r in runs if "n/a" in r["wal"]),
        "writing_txns_by_tables": {k: round(v / wal_n, 3) for k, v in sorted(by_tables.items(), key=lambda kv: -kv[1])}
        if wal_n else {},
        "wal_bytes": _per(sum(w["wal_bytes"] for w in walled), wal_n) if complete else None,
        "fpi_bytes": _per(sum(w["fpi_bytes"] for w in walled), wal_n) if complete else None,
        "fpi_bytes_by_relation": _images_by_relation(walled, wal_n) if complete else {},
        "wal_bytes_all": _per(sum(w["wal_bytes_all"] for w in walled), wal_n) if complete else None,
        "xact_commit": _per(sum(x["delta"] for x in xact), sum(x["operations"] for x in xact)),
        "cpu_ms": {role: _per(seconds, n, 1000) for role, seconds in cpu.items()},
        "wakeups": {role: _per(count, n) for role, count in counted["wakeups"].items()},
        "preemptions": {role: _per(count, n) for role, count in counted["preemptions"].items()},
        "cpu_ms_in_kernel": {role: _per(s, n, 1000) for role, s in counted["cpu_seconds_in_kernel"].items()},
        "machine_busy_percent": mean(r["machine_busy_percent"] or 0 for r in runs),
        "api_split_percent": [_split(r) for r in runs],
        "api_balance": [balance(r["cpu_seconds_api_by_process"]) for r in runs],
        "exactly_once": all(r["exactly_once"]["pass"] for r in runs),
    }


def _split(run: dict[str, Any]) -> str:
    """How a run's API CPU was shared by its worker processes, e.g. "62/38 (1.63; answers 61/39)".

    The busiest ÷ the idlest in brackets, and the same workers' shares of
    the answers where the run recorded them.
    """
    b = balance(run["cpu_seconds_api_by_process"])
    if b is None:
        return "-"
    answers = served(run.get("api_workers", []), run.get("api_answers_unplaced")).get("answers_percent")
    return ("/".join(f"{p:.0f}" for p in b["percent"]) + f" ({fmt(b['max_over_min'], 2)}"
            + (f"; answers {'/'.join(f'{p:.0f}' for p in answers)}" if answers else "") + ")")


def balance(seconds: list[float]) -> dict[str, Any] | None:
    """How evenly a round's CPU seconds were shared by the worker processes that spent them.

    Each one's share in percent, busiest first, and the busiest's seconds ÷
    the idlest's (infinite if one did nothing at all); None with fewer than
    two processes, or no CPU spent.
    """
    total = sum(seconds)
    if len(seconds) < 2 or total <= 0:
        return None
    ordered = sorted(seconds, reverse=True)
    idlest = ordered[-1]
    return {"percent": [round(100 * s / total, 1) for s in ordered],
            "max_over_min": ordered[0] / idlest if idlest > 0 else float("inf")}


def worst_balance(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round whose worker processes shared the API's CPU least evenly: its kind, round and `balance`."""
    measured = [(b, r) for r in runs if (b := balance(r.get("cpu_seconds_api_by_process", [])))]
    if not measured:
        return None
    b, r = max(measured, key=lambda br: br[0]["max_over_min"])
    return {"kind": r["kind"], "round": r["round"], **b, "connections": r.get("api_connections_by_process", []),
            **served(r.get("api_workers", []), r.get("api_answers_unplaced"))}


def served(workers: list[dict[str, Any]], unplaced: int | None) -> dict[str, Any]:
    """What tells a worker that served more from one that spent more on each answer, busiest (by CPU) first.

    Each worker's share of the answers placed on a worker, the busiest's CPU
    an answer ÷ the idlest's, each one's wait for a CPU, and the answers on
    connections closed before the end; nothing for a run from before these
    were recorded, with one worker, or with a worker no answer was placed on
    (its CPU an answer has no value).
    """
    answers = [w["requests"] for w in workers]
    if len(workers) < 2 or not sum(answers) or not all(answers):
        return {}
    first, last = workers[0], workers[-1]
    return {"answers_percent": [round(100 * n / sum(answers), 1) for n in answers],
            "cpu_per_answer_ratio": (first["cpu_seconds"] / first["requests"]) / (last["cpu_seconds"] / last["requests"])
            if last["cpu_seconds"] > 0 else None,
            "waited_seconds": [w["waited_seconds"] for w in workers],
            "answers_unplaced": unplaced}


def target(key: str, value: float | None) -> dict[str, Any]:
    name, op, goal, unit = TARGETS[key]
    goal_text = f"{op.replace('==', '=')} {goal:g}{unit}"
    if value is None:
        return {"target": name, "goal": goal_text, "value": None, "met": None, "verdict": "n/a"}
    if op == ">=":
        met, gap = value >= goal, (goal - value) / goal
        verdict = "met" if met else f"missed: {gap:.0%} short"
    elif op == "<=":
        met, gap = value <= goal, (value - goal) / goal
        verdict = "met" if met else f"missed: {gap:.0%} over"
    else:
        met = abs(value - goal) < 0.005
        verdict = "met" if met else f"missed: {value - goal:+.2f}"
    return {"target": name, "goal": goal_text, "value": value, "met": met, "verdict": verdict}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    blocks = []
    for workers in results["parameters"]["workers"]:
        runs = [r for r in results["runs"] if r["workers"] == workers]
        if not runs:
            continue
        latency = results["pooled_latency_ms"].get(str(workers), {})
        kinds = {
            kind: summarize_kind(of_kind, latency.get(kind, {}))
            for kind in (*KINDS, *WATCHING, REFUNDS)
            if (of_kind := [r for r in runs if r["kind"] == kind])
        }
        unwatched, replays_unwatched = kinds.get("unwatched"), kinds.get("replays-unwatched")
        phased, naive, replays = kinds.get("phased"), kinds.get("naive"), kinds.get("replays")
        per_round = [
            _ratio(p["run"]["per_second"], q["run"]["per_second"])
            for p in runs if p["kind"] == "phased"
            for q in runs if q["kind"] == "naive" and q["round"] == p["round"]
        ]
        judged = [r for r in per_round if r is not None]
        rate = median(judged) if judged else None
        db_cpu = _ratio(phased and phased["cpu_ms"].get(DB_BACKENDS), naive and naive["cpu_ms"].get(DB_BACKENDS))
        p99 = _ratio(phased and phased["latency_ms"].get("p99"), naive and naive["latency_ms"].get("p99"))
        replay_ratio = _ratio(replays and replays["per_second"]["mean"], phased and phased["per_second"]["mean"])
        refunds = kinds.get(REFUNDS)
        refund_ratio = _ratio(refunds and refunds["per_second"]["mean"], phased and phased["per_second"]["mean"])
        watching = _ratio(phased and phased["per_second"]["mean"], unwatched and unwatched["per_second"]["mean"])
        watching_replays = _ratio(replays and replays["per_second"]["mean"],
                                  replays_unwatched and replays_unwatched["per_second"]["mean"])
        watching_per_round = [
            _ratio(p["run"]["per_second"], q["run"]["per_second"])
            for kind, other in (("phased", "unwatched"), ("replays", "replays-unwatched"))
            for p in runs if p["kind"] == kind
            for q in runs if q["kind"] == other and q["round"] == p["round"]
        ]
        side = results.get("watching_side_by_side", {}).get(str(workers))
        side_on = watching_judged(side) if side else {}
        side_new = (side or {}).get("new_payments", {}).get("judged", {})
        outbox = results.get("outbox_side_by_side", {}).get(str(workers))
        outbox_figures = outbox["figures"] if outbox else {}
        ceiling_tps = results["ceiling"].get("tps")
        worst = worst_balance(runs) if workers > 1 else None
        blocks.append({
            "workers": workers,
            **kinds,
            "ratio": {
                "per_second": rate,
                "per_second_of_means": _ratio(phased and phased["per_second"]["mean"],
                                              naive and naive["per_second"]["mean"]),
                "per_second_per_round": per_round,
                "db_cpu": db_cpu,
                "p50": _ratio(phased and phased["latency_ms"].get("p50"), naive and naive["latency_ms"].get("p50")),
                "p99": p99,
                "replays_to_new": replay_ratio,
                "refunds_to_new": refund_ratio,
                "of_ceiling": _ratio(phased and phased["per_second"]["mean"], ceiling_tps),
                "watching": watching,
                "watching_replays": watching_replays,
                "watching_per_round": watching_per_round,
                "watching_replays_side_by_side": side_on.get("rate_ratio"),
                "watching_replays_side_by_side_cpu": side_on.get("cpu_ratio"),
                "watching_new_side_by_side": side_new.get("rate_ratio"),
                "watching_new_side_by_side_cpu": side_new.get("cpu_ratio"),
                "outbox_side_by_side_cpu": outbox_figures.get("cpu_ratio"),
                "outbox_side_by_side_rate": outbox_figures.get("rate_ratio"),
            },
            "side_by_side": side,
            "api_balance_worst": worst,
            "targets": [
                target("rate", rate),
                target("db_cpu", db_cpu),
                *([target("replays", replay_ratio)] if replays else []),
                target("writes", phased and phased["writing_txns"]),
                target("p99", p99),
                *([target("watching_new", side_new.get("rate_ratio"))] if side_new
                  else [target("watching", watching)] if unwatched else []),
                *([target("watching_replays", side_on.get("rate_ratio"))] if side else []),
                *([target("outbox", outbox_figures.get("cpu_ratio"))] if outbox else []),
                *([target("refund_writes", refunds["writing_txns"])] if refunds else []),
                *([target("balance", worst and worst["max_over_min"])] if workers > 1 else []),
            ],
        })
    return {
        "blocks": blocks,
        "exactly_once_pass": all(r["exactly_once"]["pass"] for r in results["runs"]) and bool(results["runs"])
        and all(side["exactly_once"]["pass"] for side in results.get("watching_side_by_side", {}).values())
        and all(p["exactly_once"]["pass"] for side in results.get("outbox_side_by_side", {}).values()
                for p in outbox_passes(side))
        and all(side["exactly_once"]["pass"] for side in results.get("rate_at_once", {}).values()),
    }


def outbox_passes(side: dict[str, Any]) -> list[dict[str, Any]]:
    """The outbox step's passes at one worker count (bench/run.py::outbox_side_by_side): the one with one event
    a POST, when the run also had lists, then the judged one."""
    return ([side["one_event_a_post"]] if "one_event_a_post" in side else []) + [side]


# --- Printing --------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def _rate(kind: dict[str, Any] | None) -> str:
    if not kind:
        return "-"
    r = kind["per_second"]
    return f"{fmt(r['mean'], 0)} ({fmt(r['min'], 0)}–{fmt(r['max'], 0)})" if kind["rounds"] > 1 else fmt(r["mean"], 0)


def progress_line(label: str, run: dict[str, Any]) -> str:
    r = run["run"]
    lat = r["latency_ms"]
    wal = run["wal"]
    if "n/a" in wal:
        writes = "n/a writing txns each"
    else:  # the operation's own, and the workers' beside them if they wrote
        workers = workers_own_writes(wal["by_tables"])
        writes = f"{fmt(_per(wal['transactions'] - workers, wal['operations']), 2)} writing txns each" + (
            f" and {fmt(_per(workers, wal['operations']), 2)} the workers'" if workers else "")
    verdict = "[green]ok[/]" if run["exactly_once"]["pass"] else "[bold red]FAIL[/]"
    unit = "replays" if run["kind"].startswith("replays") else REFUNDS if run["kind"] == REFUNDS else "payments"
    other = f", [yellow]{r['requests'] - r['succeeded']} not 201[/]" if r["requests"] > r["succeeded"] else ""
    return (f"{label}: {fmt(r['per_second'], 0)} {unit}/s, p50 {fmt(lat['p50'])} ms, p99 {fmt(lat['p99'])} ms, "
            f"{writes}, busy {fmt(run['machine_busy_percent'], 0)}%{other}; exactly-once {verdict}")


def _cpu_rows(table: Table, columns: list[dict[str, Any] | None], unit: str) -> None:
    roles: list[str] = []
    for kind in columns:
        for role in (kind or {}).get("cpu_ms", {}):
            if role not in roles:
                roles.append(role)
    for role in roles:
        label = f"CPU ms per {unit}: {role.strip()}" if not role.startswith("  ") else f"    {role.strip()}"
        table.add_row(label, *[fmt((k or {}).get("cpu_ms", {}).get(role), 2) for k in columns], "")


def print_block(results: dict[str, Any], block: dict[str, Any]) -> None:
    w = block["workers"]
    p = results["parameters"]
    phased, naive, replays, ratio = block.get("phased"), block.get("naive"), block.get("replays"), block["ratio"]
    table = Table(
        title=f"{w} worker{'s' if w > 1 else ''} per API: phased service vs naive twin — {p['concurrency']} clients, "
              f"{p['rounds']} round{'s' if p['rounds'] > 1 else ''} × {p['duration_s']:g} s, alternating",
        title_justify="left",
    )
    table.add_column("figure")
    table.add_column("phased", justify="right")
    table.add_column("naive", justify="right")
    table.add_column("phased ÷ naive", justify="right")
    per_round = [r for r in ratio["per_second_per_round"] if r is not None]
    spread = f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else ""
    table.add_row("new payments/s: mean (min–max); ratio: median of the rounds' (min–max)", _rate(phased),
                  _rate(naive), fmt(ratio["per_second"], 2, "×") + spread)
    for q in ("p50", "p99"):
        table.add_row(f"latency {q} (ms)", fmt((phased or {}).get("latency_ms", {}).get(q)),
                      fmt((naive or {}).get("latency_ms", {}).get(q)), fmt(ratio[q], 2, "×"))
    table.add_row("writing transactions per payment (WAL)", fmt((phased or {}).get("writing_txns"), 2),
                  fmt((naive or {}).get("writing_txns"), 2), "")
    table.add_row("the workers' own writing transactions per payment (WAL: the webhook cursor, scheduled runs)",
                  fmt((phased or {}).get("workers_writing_txns"), 2),
                  fmt((naive or {}).get("workers_writing_txns"), 2), "")
    table.add_row("WAL bytes per payment (of which page images)",
                  *[f"{fmt(k.get('wal_bytes'), 0)} ({fmt(k.get('fpi_bytes'), 0)})" if k else "-"
                    for k in (phased, naive)], "")
    table.add_row("  page images' bytes per payment, the three largest relations",
                  *[_largest_images(k) for k in (phased, naive)], "")
    table.add_row("xact_commit per payment (read-only too)", fmt((phased or {}).get("xact_commit"), 2),
                  fmt((naive or {}).get("xact_commit"), 2), "")
    _cpu_rows(table, [phased, naive], "payment")
    for key, label in (("cpu_ms_in_kernel", "of the CPU ms, the kernel's"), ("wakeups", "wake-ups"),
                       ("preemptions", "preemptions")):
        for role in COUNTED_APART:
            if any(role in (k or {}).get(key, {}) for k in (phased, naive)):
                table.add_row(f"{label} per payment: {role}", *[fmt((k or {}).get(key, {}).get(role), 2)
                                                                 for k in (phased, naive)], "")
    table.add_row("machine busy (both CPUs = 100%)", fmt((phased or {}).get("machine_busy_percent"), 0, "%"),
                  fmt((naive or {}).get("machine_busy_percent"), 0, "%"), "")
    if w > 1:
        table.add_row("API workers' CPU % (max ÷ min), per round",
                      *[", ".join((k or {}).get("api_split_percent", [])) for k in (phased, naive)], "")
    table.add_row("requests not answered 201", str((phased or {}).get("not_201", "-")),
                  str((naive or {}).get("not_201", "-")), "")
    table.add_row("exactly-once, every round", *[_pass(k) for k in (phased, naive)], "")
    console.print(table)
    for kind in (phased, naive):
        if kind and kind["writing_txns"] is None and kind["writing_txns_n/a"]:
            console.print(f"[yellow]writing transactions per payment: n/a ({kind['writing_txns_n/a']})[/]")
            break

    shapes = Table(title=f"{w}w: writing transactions per payment, by the tables each one wrote (from the WAL)",
                   title_justify="left")
    shapes.add_column("tables written in one transaction")
    shapes.add_column("phased", justify="right")
    shapes.add_column("naive", justify="right")
    names = list(dict.fromkeys([*(phased or {}).get("writing_txns_by_tables", {}),
                                *(naive or {}).get("writing_txns_by_tables", {})]))
    for name in names:
        shapes.add_row(name.replace("+", " + "),
                       *[fmt(v, 2) if (v := (k or {}).get("writing_txns_by_tables", {}).get(name)) else "–"
                         for k in (phased, naive)])
    if names:
        console.print(shapes)

    if replays:
        rt = Table(title=f"{w}w: replays of finished payments (phased service, "
                         f"{p['replay_duration_s']:g} s, up to {p['replay_keys_max']} keys round robin)",
                   title_justify="left")
        rt.add_column("figure")
        rt.add_column("replays", justify="right")
        rt.add_column("", justify="right")
        rt.add_row("replays/s", fmt(replays["per_second"]["mean"], 0),
                   f"{fmt(ratio['replays_to_new'], 1, '×')} new payments/s")
        for q in ("p50", "p99"):
            rt.add_row(f"latency {q} (ms)", fmt(replays["latency_ms"].get(q), 2), "")
        rt.add_row("writing transactions per replay (WAL)", fmt(replays["writing_txns"], 3), "")
        rt.add_row("xact_commit per replay (read-only too)", fmt(replays["xact_commit"], 2), "")
        _cpu_rows(rt, [replays], "replay")
        rt.add_row("machine busy", fmt(replays["machine_busy_percent"], 0, "%"), "")
        if w > 1:
            rt.add_row("API workers' CPU % (max ÷ min)", ", ".join(replays["api_split_percent"]), "")
        rt.add_row("exactly-once (byte-identical, nothing charged)", _pass(replays), "")
        console.print(rt)
    print_refunds(results, block)
    print_watching(block)
    print_balance(block)


def print_balance(block: dict[str, Any]) -> None:
    """One line: how the least even round at this worker count split the API's CPU between its processes."""
    worst = block.get("api_balance_worst")
    if block["workers"] < 2:
        return
    if worst is None:
        console.print(f"[yellow]{block['workers']}w: API workers' CPU: n/a (no round measured two worker processes)[/]")
        return
    goal = TARGETS["balance"][2]
    colour = "green" if worst["max_over_min"] <= goal else "red"
    console.print(f"[{colour}]{block['workers']}w: API workers' CPU, least even round ({worst['kind']} round "
                  f"{worst['round']}): {' / '.join(f'{p:.0f}%' for p in worst['percent'])}, max ÷ min "
                  f"{fmt(worst['max_over_min'], 2)}, target ≤ {goal:.2f}"
                  + (f"; clients' connections held {' / '.join(map(str, held))}" if (held := worst.get("connections"))
                     else "")
                  + (f"; answers served {' / '.join(f'{p:.0f}%' for p in worst['answers_percent'])}, CPU an answer "
                     f"busiest ÷ idlest {fmt(worst['cpu_per_answer_ratio'], 2)}, waited for a CPU "
                     f"{' / '.join(f'{s:.2f} s' for s in worst['waited_seconds'])}"
                     f" ({worst['answers_unplaced']} answer{'' if worst['answers_unplaced'] == 1 else 's'} on "
                     f"connections closed during the round)"
                     if "answers_percent" in worst else "") + "[/]")


def print_refunds(results: dict[str, Any], block: dict[str, Any]) -> None:
    """The refund round beside the new payments: its rate, latency, writes and CPU per refund."""
    refunds, phased = block.get(REFUNDS), block.get("phased")
    if not refunds:
        return
    w = block["workers"]
    table = Table(title=f"{w}w: partial refunds of the rounds' payments (phased service, "
                        f"{results['parameters']['concurrency']} clients, {results['parameters']['duration_s']:g} s, "
                        "after every other step)",
                  title_justify="left")
    table.add_column("figure")
    table.add_column("refunds", justify="right")
    table.add_column("new payments", justify="right")
    table.add_column("refunds ÷ new payments", justify="right")
    table.add_row("per second", fmt(refunds["per_second"]["mean"], 0), _rate(phased),
                  fmt(block["ratio"]["refunds_to_new"], 2, "×"))
    for q in ("p50", "p99"):
        a, b = refunds["latency_ms"].get(q), (phased or {}).get("latency_ms", {}).get(q)
        table.add_row(f"latency {q} (ms)", fmt(a), fmt(b), fmt(_ratio(a, b), 2, "×"))
    table.add_row("writing transactions each (WAL)", fmt(refunds["writing_txns"], 2),
                  fmt((phased or {}).get("writing_txns"), 2), "")
    for name, share in refunds["writing_txns_by_tables"].items():
        table.add_row(f"  of which writing {name.replace('+', ' + ')}", fmt(share, 2), "", "")
    table.add_row("WAL bytes each (of which page images)",
                  *[f"{fmt(k.get('wal_bytes'), 0)} ({fmt(k.get('fpi_bytes'), 0)})" if k else "-"
                    for k in (refunds, phased)], "")
    table.add_row("xact_commit each (read-only too)", fmt(refunds["xact_commit"], 2),
                  fmt((phased or {}).get("xact_commit"), 2), "")
    for role in refunds["cpu_ms"]:
        if role.startswith("  "):
            continue
        table.add_row(f"CPU ms each: {role}", fmt(refunds["cpu_ms"].get(role), 2),
                      fmt((phased or {}).get("cpu_ms", {}).get(role), 2), "")
    table.add_row("requests not answered 201 succeeded", str(refunds["not_201"]), "", "")
    table.add_row("exactly-once (one PSP refund each, posted and balanced)", _pass(refunds), "", "")
    console.print(table)


def watching_judged(side: dict[str, Any]) -> dict[str, Any]:
    """The watched API's judged ratios of a watching step: the median over its pairs of APIs, or, in a result
    from before the step had pairs, its one pair's."""
    return side["judged"] if "judged" in side else side["figures"]["on"]


def print_watching(block: dict[str, Any]) -> None:
    """Metrics and logs on (the defaults) beside off, for new payments and replays: what watching costs."""
    w, ratio = block["workers"], block["ratio"]
    pairs = [("new payments", block.get("phased"), block.get("unwatched"), ratio.get("watching"), "payment"),
             ("replays", block.get("replays"), block.get("replays-unwatched"), ratio.get("watching_replays"), "replay")]
    if not any(off for _, _, off, _, _ in pairs):
        return
    table = Table(title=f"{w}w: the cost of watching: the phased service with metrics and logs (the defaults) "
                        "and without (METRICS_ENABLED=false, LOG_LEVEL=WARNING), side by side",
                  title_justify="left")
    table.add_column("figure")
    table.add_column("on", justify="right")
    table.add_column("off", justify="right")
    table.add_column("on ÷ off", justify="right")
    for name, on, off, r, unit in pairs:
        if not (on and off):
            continue
        table.add_row(f"{name}/s, rounds one after the other: mean (min–max)", _rate(on), _rate(off), fmt(r, 3, "×"))
        for q in ("p50", "p99"):
            a, b = on["latency_ms"].get(q), off["latency_ms"].get(q)
            table.add_row(f"  latency {q} (ms)", fmt(a, 2), fmt(b, 2), fmt(_ratio(a, b), 2, "×"))
        a, b = on["cpu_ms"].get("API"), off["cpu_ms"].get("API")
        table.add_row(f"  API CPU ms per {unit}", fmt(a, 3), fmt(b, 3), fmt(_ratio(a, b), 3, "×"))
    per_round = [x for x in ratio.get("watching_per_round", []) if x is not None]
    if per_round:
        table.add_row("on ÷ off, each round one after the other (new payments, then replays)", ", ".join(f"{x:.2f}" for x in per_round),
                      "", "")
    side = block.get("side_by_side")
    if side:
        pairs = side.get("pairs") or [{"whose": "one pair", "figures": side["figures"]}]
        new = side.get("new_payments")
        for pair in pairs if new else []:
            on, off = pair["new_payments"]["on"], pair["new_payments"]["off"]
            table.add_row(f"new payments at once ({pair['whose']}), {new['rounds']} rounds of {new['seconds']:g} s: "
                          "payments/s, median of the rounds' ratios",
                          fmt(statistics.median(on["per_second"]), 0), fmt(statistics.median(off["per_second"]), 0),
                          fmt(on["rate_ratio"], 3, "×"))
            table.add_row("  API CPU ms per payment, median of the rounds' ratios",
                          fmt(on["cpu_ms_per_request_median"], 3), fmt(off["cpu_ms_per_request_median"], 3),
                          fmt(on["cpu_ratio"], 3, "×"))
        if new:
            judged = new["judged"]
            table.add_row(f"new payments/s on ÷ off, the median of {judged['pairs']} pairs (the judged figure)", "", "",
                          fmt(judged["rate_ratio"], 3, "×"))
            table.add_row("  API CPU per payment on ÷ off, the median of the pairs", "", "",
                          fmt(judged["cpu_ratio"], 3, "×"))
        for pair in pairs:
            on, off = pair["figures"]["on"], pair["figures"]["off"]
            table.add_row(f"replays at once on one CPU ({pair['whose']}), {side['rounds']} rounds of "
                          f"{side['seconds']:g} s: replays/s, median of the rounds' ratios",
                          fmt(statistics.median(on["per_second"]), 0), fmt(statistics.median(off["per_second"]), 0),
                          fmt(on["rate_ratio"], 3, "×"))
            table.add_row("  API CPU ms per replay, median of the rounds' ratios",
                          fmt(on["cpu_ms_per_request_median"], 3), fmt(off["cpu_ms_per_request_median"], 3),
                          fmt(on["cpu_ratio"], 3, "×"))
            table.add_row("  replays/s on ÷ off, each round",
                          ", ".join(f"{x:.2f}" for x in on["rate_ratio_per_round"]), "", "")
        if "judged" in side:
            judged = side["judged"]
            # `measured` since 2026-12-06: a result before it counted every pair measured in `pairs`.
            of = f" of {judged['measured']} measured" if judged.get("measured", judged["pairs"]) != judged["pairs"] else ""
            table.add_row(f"replays/s on ÷ off, the median of {judged['pairs']} pairs{of} (the judged figure)", "", "",
                          fmt(judged["rate_ratio"], 3, "×"))
            table.add_row("  API CPU per replay on ÷ off, the median of the pairs", "", "",
                          fmt(judged["cpu_ratio"], 3, "×"))
    console.print(table)


def _pass(kind: dict[str, Any] | None) -> str:
    if not kind:
        return "-"
    return f"[green]PASS[/] ({kind['rounds']})" if kind["exactly_once"] else "[bold red]FAIL[/]"


def print_ceiling(results: dict[str, Any]) -> None:
    c = results["ceiling"]
    table = Table(title="The database-only ceiling: the service's SQL for one payment in pgbench (no Python, no HTTP)",
                  title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    if "tps" not in c or c.get("tps") is None:
        table.add_row("payments/s the database alone could do", f"n/a: {c.get('n/a')}")
        console.print(table)
        return
    table.add_row(f"payments/s the database alone could do ({c['clients']} connections, {c['duration_s']:g} s)",
                  fmt(c["tps"], 0))
    for block in results["blocks"]:
        phased = block.get("phased")
        if phased:
            table.add_row(f"phased service, {block['workers']}w: payments/s and fraction of that",
                          f"{fmt(phased['per_second']['mean'], 0)} = {fmt(block['ratio']['of_ceiling'], 2)}")
    for title, ms in c["statement_ms"].items():
        table.add_row(f"  pgbench latency: {title}", f"{ms:.2f} ms")
    for role, ms in c["cpu_ms_per_payment"].items():
        if role != LOAD_GENERATOR:
            table.add_row(f"  CPU ms per payment: {role.strip()}", fmt(ms, 3))
    table.add_row("  machine busy during pgbench", fmt(c.get("machine_busy_percent"), 0, "%"))
    table.add_row("  failed transactions", str(c["failed"]))
    console.print(table)


def print_targets(results: dict[str, Any]) -> None:
    table = Table(title="Targets, each measured as a ratio in this run", title_justify="left")
    table.add_column("workers")
    table.add_column("target")
    table.add_column("goal", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("verdict")
    for block in results["blocks"]:
        for t in block["targets"]:
            colour = "green" if t["met"] else "red" if t["met"] is False else "yellow"
            table.add_row(str(block["workers"]), t["target"], t["goal"], fmt(t["value"], 2),
                          f"[{colour}]{t['verdict']}[/]")
    console.print(table)


def setup_table(results: dict[str, Any]) -> Table:
    """The "Machine and parameters" table with its first two rows, the machine and the server (bench/growth too)."""
    m, p = results["machine"], results["parameters"]
    table = Table(title="Machine and parameters", title_justify="left", show_header=False)
    table.add_column("name")
    table.add_column("value")
    settings = ", ".join(f"{k}={v}" for k, v in m["postgresql_settings"].items())
    table.add_row("machine", f"{m['nproc']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, "
                             f"load {m['load_average_1m_at_start']} at start; everything on this machine")
    table.add_row("PostgreSQL", f"{m['postgresql']} ({p['server']}; {settings})")
    return table


def print_setup(results: dict[str, Any]) -> None:
    m, p = results["machine"], results["parameters"]
    table = setup_table(results)
    rounds = (f"{p['rounds']} rounds × (phased, naive), each {p['warmup_s']:g} s warm-up + {p['duration_s']:g} s "
              "(--rate-only)" if p.get("rate_only") else
              f"{p['rounds']} rounds × (phased, unwatched, webhooks, naive), each {p['warmup_s']:g} s warm-up + "
              f"{p['duration_s']:g} s; replays {p['replay_duration_s']:g} s each, watched and unwatched; "
              f"refunds {p['warmup_s']:g} s warm-up + {p['duration_s']:g} s; pgbench {p['pgbench_duration_s']:g} s")
    table.add_row("runs", f"{p['concurrency']} clients; per worker count ({', '.join(map(str, p['workers']))}): "
                          f"{rounds}; {results.get('wall_clock_s', 0):.0f} s in all")
    table.add_row("load generator", f"{p['load_generator']}, Python {m['python']}, in the bench's own process")
    console.print(table)


NOTES = [
    "writing transactions: transactions that wrote a table of payments_bench and committed, decoded from the WAL "
    "(pg_waldump). Target 3 for the phased service; the naive twin commits each of its 5 writes on its own.",
    "xact_commit counts read-only transactions too (the lookup of the caller and its key; a replay is only reads), "
    "over each run's warm-up and run, plus the exactly-once check's own few reads.",
    "The fakes keep their records in payments_bench_rails: their writes are in neither count, but their CPU is.",
    "WAL bytes include full-page images, written for the first change to each page after a checkpoint: "
    "they swing with the checkpoint's timing; the rest is the rows and index entries themselves.",
    "writing transactions per refund: target 2, the claim (key row, the amount reserved on the payment, the "
    "refund created) and the PSP's answer recorded (the refund, its posting, the key row finished).",
    "The naive twin passes the exactly-once check too: nothing fails in these runs, so nothing is retried. "
    "It charges twice only after a crash or a lost response (make demo-naive-crash).",
]


def print_rate_at_once(results: dict[str, Any]) -> None:
    """bench/rate_at_once.py's rounds, per worker count: the rate and the costs with both sides at the same moments."""
    steps = results.get("rate_at_once", {})
    if not steps:
        return
    services = next(iter(steps.values())).get("services", {"phased": "phased", "naive": "naive"})
    if services["phased"] == services["naive"]:  # --at-once naive,naive or phased,phased
        who = (f"a control, the {'naive twin' if services['phased'] == 'naive' else 'phased service'} on both sides "
               "(the columns keep the step's names)")
    else:
        who = "the phased service and the naive twin"
    table = Table(title=f"new payments, {who} at once (bench/rate_at_once.py; not judged): medians of the rounds",
                  title_justify="left")
    for column in ("workers", "figure", "phased", "naive", "phased ÷ naive (the rounds')"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for workers, step in steps.items():
        f, m = step["figures"], step["figures"]["medians"]
        rows = (("payments/s", "per_second", 1, "rate_ratio"),
                ("the service's CPU ms a payment", "service_ms", 3, "cpu_ratio"),
                ("  its API's", "api_ms", 3, None),
                ("  its database sessions'", "sessions_ms", 3, "db_ratio"),
                ("  its worker's, with its sessions", "worker_ms", 3, None),
                ("its fakes' CPU ms a payment, with their sessions", "fakes_ms", 3, "fakes_ratio"),
                ("  the fake PSP's", "psp_ms", 3, None),
                ("  the fake rail's", "rail_ms", 3, None),
                ("the fake PSP woken, a payment", "psp_wakeups", 2, None),
                ("the fake rail woken, a payment", "rail_wakeups", 2, None),
                ("its calls at the fake PSP: the median gap, ms", "psp_gap_ms", 2, None),
                (f"  the share within {rate_at_once.BUNCHED * 1000:g} ms of the one before", "psp_bunched", 2, None),
                ("the service's and its fakes', a payment", "whole_ms", 3, "whole_ratio"))
        for label, part, digits, ratio in rows:
            if part not in m["phased"]:  # a run from before the step read it, or a control (no arrivals)
                continue
            rounds = ", ".join(fmt(r.get(ratio), 2) for r in f["rounds"]) if ratio else ""
            table.add_row(workers, label, fmt(m["phased"].get(part), digits), fmt(m["naive"].get(part), digits),
                          f"{fmt(f.get(ratio), 3)} ({rounds})" if ratio else "")
    console.print(table)


def print_report(results: dict[str, Any]) -> None:
    for block in results["blocks"]:
        print_block(results, block)
    if results["ceiling"]:
        print_ceiling(results)
    print_targets(results)
    print_rate_at_once(results)
    print_setup(results)
    for note in NOTES:
        console.print(f"[dim]- {note}[/]")
    for block in results["blocks"]:
        if any(c.get(LOAD_GENERATOR, 0) > c.get("API", 0)
               for k in ("phased", "naive") if (c := (block.get(k) or {}).get("cpu_ms"))):
            console.print(f"[yellow]- {block['workers']}w: the load generator spent more CPU per payment than an "
                          "API: the rates are partly a measure of the client.[/]")
    disturbed = []
    for run in results["runs"]:
        cpu = run["cpu_seconds"]
        other = cpu.get(OTHERS, 0.0) + cpu.get(PG_PARTS["other"], 0.0)
        if cpu.get(MACHINE) and other > 0.1 * cpu[MACHINE]:
            disturbed.append((run, other / cpu[MACHINE]))
    if disturbed:
        worst = max(share for _, share in disturbed)
        names = sorted({name for run, _ in disturbed for name in run["cpu_seconds_busiest_other_processes"]
                        if not name.startswith("[")})
        console.print(f"[yellow]- Other work on this machine (processes and PostgreSQL sessions not the bench's) "
                      f"took over 10% of its CPU in {len(disturbed)} of {len(results['runs'])} runs (up to "
                      f"{worst:.0%}; {', '.join(names[:6])}): those runs' rates are disturbed. Run the bench again "
                      "on a quiet machine.[/]", highlight=False)
    failed = [r for r in results["runs"] if not r["exactly_once"]["pass"]]
    for run in failed:
        for c in run["exactly_once"]["checks"]:
            if not c["ok"]:
                console.print(f"[red]FAIL[/] {run['workers']}w round {run['round']} {run['kind']}: "
                              f"{c['check']}: {c['detail']}")
    for step in ("watching_side_by_side", "outbox_side_by_side", "rate_at_once"):
        for workers, side in results.get(step, {}).items():
            for p in outbox_passes(side):  # a watching step, or the rate's at once, has one pass
                for c in p["exactly_once"]["checks"]:
                    console.print(f"[red]FAIL[/] {workers}w {step.replace('_', ' ')}: {c['check']}: {c['detail']}")
    verdict = "[bold green]PASS[/]" if results["exactly_once_pass"] else "[bold red]FAIL[/]"
    console.print(f"exactly-once, after every run: {verdict}")


if __name__ == "__main__":
    print_report(json.loads(open(sys.argv[1]).read()))
