"""The growth bench's figures: summarised per size, held against the targets, printed.

Everything here reads the results dictionary that is also written as JSON, so
a saved result prints again with `python -m bench.growth.report FILE`. As in
`make bench` (bench/report.py): rates are the mean over rounds with their
min-max beside them, latency percentiles are over all rounds' requests pooled,
and the ratios are the figures to quote, because the two databases were
driven in alternation, in one run, with the same load.
"""

from __future__ import annotations

import json
import sys
from statistics import mean
from typing import Any

from rich.table import Table

from bench.load import latency_ms
from bench.report import fmt, setup_table
from bench.system import console

EMPTY, GROWN = "empty", "preloaded"
NEW, REPLAYS, OLD_REPLAYS = "new payments", "replays", "replays of preloaded keys"
RATE_GOAL = 0.8  # within 20% of the empty table's
DROP_SECONDS_GOAL = 1.0
DROP_WAL_GOAL = 1 << 20


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rounds of one kind on one database at one size: mean rate, min-max, pooled latency."""
    if not runs:
        return None
    rates = [r["per_second"] for r in runs]
    latencies = sorted(x for r in runs for x in r["latencies_s"])
    return {
        "rounds": len(runs),
        "per_second": {"mean": mean(rates), "min": min(rates), "max": max(rates)},
        "latency_ms": latency_ms(latencies),
        "succeeded": sum(r["succeeded"] for r in runs),
        "not_as_expected": sum(r["requests"] - r["succeeded"] for r in runs),
        "exactly_once": all(c["ok"] for r in runs for c in r["checks"]),
    }


def target(name: str, value: float | None, goal: float, op: str) -> dict[str, Any]:
    met = None if value is None else value >= goal if op == ">=" else value < goal
    return {"target": name, "goal": f"{op} {goal:g}", "value": value, "met": met}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per preloaded size: each kind on each database, their ratios, the targets; the removal's targets."""
    blocks = []
    for size in results["parameters"]["sizes"]:
        runs = [r for r in results["runs"] if r["size"] == size]
        figures = {
            kind: {db: summarize_runs([r for r in runs if r["kind"] == kind and r["database"] == db])
                   for db in (EMPTY, GROWN)}
            for kind in (NEW, REPLAYS, OLD_REPLAYS)
        }

        def rate(kind: str, db: str) -> float | None:
            f = figures[kind][db]
            return f["per_second"]["mean"] if f else None

        def p99(kind: str, db: str) -> float | None:
            f = figures[kind][db]
            return f["latency_ms"]["p99"] if f else None

        ratios = {
            "new_per_second": _ratio(rate(NEW, GROWN), rate(NEW, EMPTY)),
            "new_p99": _ratio(p99(NEW, GROWN), p99(NEW, EMPTY)),
            "replays_per_second": _ratio(rate(REPLAYS, GROWN), rate(REPLAYS, EMPTY)),
            "replays_p99": _ratio(p99(REPLAYS, GROWN), p99(REPLAYS, EMPTY)),
            # Not like for like: old keys on the large table against recent keys on the empty one.
            "old_replays_per_second": _ratio(rate(OLD_REPLAYS, GROWN), rate(REPLAYS, EMPTY)),
            "old_replays_p99": _ratio(p99(OLD_REPLAYS, GROWN), p99(REPLAYS, EMPTY)),
        }
        per_round = [
            _ratio(g["per_second"], e["per_second"])
            for g in runs if g["kind"] == NEW and g["database"] == GROWN
            for e in runs if e["kind"] == NEW and e["database"] == EMPTY and e["round"] == g["round"]
        ]
        blocks.append({
            "size": size,
            "key_rows": next((r["key_rows"] for r in runs if r["database"] == GROWN), None),
            "figures": figures,
            "ratios": ratios | {"new_per_second_per_round": per_round},
            "targets": [
                target("new payments/s: preloaded ÷ empty", ratios["new_per_second"], RATE_GOAL, ">="),
                target("replays/s: preloaded ÷ empty", ratios["replays_per_second"], RATE_GOAL, ">="),
            ],
        })
    removal = results.get("removal") or {}
    drop = removal.get("drop")
    # The targets are about the drop: its transaction. The whole reap (the day's
    # rows counted, the live ones moved out) is printed beside it.
    removal_targets = [
        target("partition drop: seconds", drop.get("drop_seconds"), DROP_SECONDS_GOAL, "<"),
        target("partition drop: WAL bytes", drop.get("drop_wal_bytes"), DROP_WAL_GOAL, "<"),
        target("the whole reap of the day: seconds", drop["seconds"], DROP_SECONDS_GOAL, "<"),
        target("the whole reap of the day: WAL bytes", drop["wal_bytes"], DROP_WAL_GOAL, "<"),
    ] if drop else []
    checks = [c for r in results["runs"] for c in r["checks"]] + results.get("checks", [])
    return {
        "blocks": blocks,
        "removal_targets": removal_targets,
        "checks_pass": all(c["ok"] for c in checks),
    }


# --- Printing --------------------------------------------------------------------------


def _rate(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"
    r = f["per_second"]
    return f"{fmt(r['mean'], 0)} ({fmt(r['min'], 0)}–{fmt(r['max'], 0)})" if f["rounds"] > 1 else fmt(r["mean"], 0)


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} B"


def _verdict(t: dict[str, Any]) -> str:
    return "[yellow]n/a[/]" if t["met"] is None else "[green]met[/]" if t["met"] else "[red]missed[/]"


def print_block(results: dict[str, Any], block: dict[str, Any]) -> None:
    p = results["parameters"]
    f, ratios = block["figures"], block["ratios"]
    rows = block["key_rows"]
    table = Table(
        title=f"{block['size']:,} preloaded payments ({fmt(rows, 0) if rows else '?'} key rows) vs an empty "
              f"database: {p['concurrency']} clients, {p['rounds']} round{'s' if p['rounds'] > 1 else ''} × "
              f"{p['seconds']:g} s, alternating",
        title_justify="left",
    )
    for column, justify in (("figure", "left"), ("empty", "right"), ("preloaded", "right"),
                            ("preloaded ÷ empty", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    per_round = [r for r in ratios["new_per_second_per_round"] if r is not None]
    spread = f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else ""
    table.add_row("new payments/s: mean (min–max)", _rate(f[NEW][EMPTY]), _rate(f[NEW][GROWN]),
                  fmt(ratios["new_per_second"], 2, "×") + spread)
    for q in ("p50", "p99"):
        table.add_row(f"  latency {q} (ms)", *[fmt((f[NEW][db] or {}).get("latency_ms", {}).get(q))
                                                for db in (EMPTY, GROWN)],
                      fmt(ratios["new_p99"], 2, "×") if q == "p99" else "")
    table.add_row("replays/s of this run's keys", _rate(f[REPLAYS][EMPTY]), _rate(f[REPLAYS][GROWN]),
                  fmt(ratios["replays_per_second"], 2, "×"))
    for q in ("p50", "p99"):
        table.add_row(f"  latency {q} (ms)", *[fmt((f[REPLAYS][db] or {}).get("latency_ms", {}).get(q), 2)
                                                for db in (EMPTY, GROWN)],
                      fmt(ratios["replays_p99"], 2, "×") if q == "p99" else "")
    old = f[OLD_REPLAYS][GROWN]
    table.add_row("replays/s of preloaded keys (days old, spread over the table)", "-", _rate(old),
                  fmt(ratios["old_replays_per_second"], 2, "×") + " of the empty's replays")
    table.add_row("  latency p99 (ms)", "-", fmt((old or {}).get("latency_ms", {}).get("p99"), 2),
                  fmt(ratios["old_replays_p99"], 2, "×"))
    table.add_row("requests not answered as expected",
                  *[str(sum((f[k][db] or {}).get("not_as_expected", 0) for k in f)) for db in (EMPTY, GROWN)], "")
    table.add_row("exactly-once, every run",
                  *["[green]PASS[/]" if all((f[k][db] or {}).get("exactly_once", True) for k in f)
                    else "[bold red]FAIL[/]" for db in (EMPTY, GROWN)], "")
    console.print(table)


def print_removal(results: dict[str, Any]) -> None:
    removal = results.get("removal")
    if not removal:
        return
    drop, delete = removal["drop"], removal["delete"]
    table = Table(title=f"Removing one day of keys ({drop['rows_before']:,} rows in each of two identical days)",
                  title_justify="left")
    for column, justify in (("figure", "left"), ("drop (the reaper)", "right"), ("DELETE", "right"),
                            ("DELETE ÷ drop", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_row("rows removed (live rows moved out first)", f"{drop['rows_removed']:,} ({drop['rows_moved']:,})",
                  f"{delete['rows_removed']:,} ({delete['rows_before'] - delete['rows_removed']:,} kept)", "")
    table.add_row("wall time (s): the whole reap / the DELETE", fmt(drop["seconds"], 3), fmt(delete["seconds"], 3),
                  fmt(_ratio(delete["seconds"], drop["seconds"]), 1, "×"))
    table.add_row("WAL written: the whole reap / the DELETE", _bytes(drop["wal_bytes"]), _bytes(delete["wal_bytes"]),
                  fmt(_ratio(delete["wal_bytes"], drop["wal_bytes"]), 0, "×"))
    table.add_row("  of the reap, its drop transaction: time (s), WAL",
                  f"{fmt(drop.get('drop_seconds'), 3)}, {_bytes(drop.get('drop_wal_bytes'))}", "", "")
    looked = drop.get("lookups") or {}
    if looked.get("count"):
        table.add_row("  meanwhile, a key of today looked up: times, median / slowest (ms)",
                      f"{looked['count']}, {fmt(looked['median_ms'], 1)} / {fmt(looked['slowest_ms'], 1)}", "", "")
    table.add_row("then VACUUM of the partition: time (s), WAL", "-",
                  f"{fmt(delete['vacuum_seconds'], 2)}, {_bytes(delete['vacuum_wal_bytes'])}", "")
    for part in ("heap", "indexes"):
        table.add_row(f"{part}: before → after (after VACUUM for DELETE)",
                      f"{_bytes(drop['before'][part])} → {_bytes(drop['after'][part])}",
                      f"{_bytes(delete['before'][part])} → {_bytes(delete['after'][part])}", "")
    console.print(table)


def print_targets(results: dict[str, Any]) -> None:
    table = Table(title="Targets (printed, never a reason to fail: at small sizes they mean little)",
                  title_justify="left")
    for column in ("size", "target", "goal", "measured", "verdict"):
        table.add_column(column)
    for block in results["blocks"]:
        for t in block["targets"]:
            table.add_row(f"{block['size']:,}", t["target"], t["goal"], fmt(t["value"], 2), _verdict(t))
    for t in results["removal_targets"]:
        value = _bytes(t["value"]) if "WAL" in t["target"] else fmt(t["value"], 3)
        goal = "< 1 MiB" if "WAL" in t["target"] else t["goal"]
        table.add_row("one day", t["target"], goal, value, _verdict(t))
    console.print(table)


def print_setup(results: dict[str, Any]) -> None:
    p = results["parameters"]
    table = setup_table(results)
    table.add_row("preload", "; ".join(f"{s['rows']:,} rows in {s['seconds']:.0f} s, VACUUM ANALYZE "
                                       f"{s['vacuum_seconds']:.0f} s" for s in results["preloads"]))
    rounds = f"{p['rounds']} round{'s' if p['rounds'] > 1 else ''}"
    table.add_row("runs", f"{p['concurrency']} clients, `payments api --workers {p['workers']}` on each database; "
                          f"per size {rounds} × (new payments {p['seconds']:g} s, replays "
                          f"{p['replay_seconds']:g} s), each after a {p['warmup_s']:g} s warm-up; "
                          f"retention {p['retention_hours']:g} h; {results.get('wall_clock_s', 0):.0f} s in all")
    console.print(table)


def print_report(results: dict[str, Any]) -> None:
    for block in results["blocks"]:
        print_block(results, block)
    print_removal(results)
    print_targets(results)
    print_setup(results)
    failed = [c for r in results["runs"] for c in r["checks"] if not c["ok"]]
    failed += [c for c in results.get("checks", []) if not c["ok"]]
    for c in failed:
        console.print(f"[red]FAIL[/] {c['name']}: {c['detail']}")
    verdict = "[bold green]PASS[/]" if results["checks_pass"] else "[bold red]FAIL[/]"
    console.print(f"exactly-once and the bench's own checks: {verdict}")


if __name__ == "__main__":
    print_report(json.loads(open(sys.argv[1]).read()))
