"""The bench's two passes of the outbox's rounds: one event a POST beside lists, the target judged on lists,
and the exactly-once verdict failing when either pass failed its checks."""

from __future__ import annotations

from typing import Any

from bench.report import summarize
from tests.tooling.test_bench_balance import _results, _run


def _pass(cpu_ratio: float, ok: bool = True) -> dict[str, Any]:
    return {"rounds": 6, "seconds": 5.0, "figures": {"cpu_ratio": cpu_ratio, "rate_ratio": 1.0},
            "exactly_once": {"pass": ok, "checks": [] if ok else [{"check": "applied", "ok": False, "detail": "-"}]}}


def _with_outbox(one_event_ok: bool = True) -> dict[str, Any]:
    results = _results([_run("phased", 1, 1, [5.0])])
    results["outbox_side_by_side"] = {
        "1": _pass(1.03) | {"events_per_post": 16, "one_event_a_post": _pass(1.06, one_event_ok)}}
    return results


def test_the_outbox_target_is_judged_on_the_pass_with_lists_not_the_one_beside_it():
    [target] = [t for t in summarize(_with_outbox())["blocks"][0]["targets"] if "webhooks" in t["target"]]

    assert target["value"] == 1.03 and target["met"] is True


def test_a_failed_check_in_the_pass_with_one_event_a_post_fails_the_run():
    assert summarize(_with_outbox())["exactly_once_pass"] is True
    assert summarize(_with_outbox(one_event_ok=False))["exactly_once_pass"] is False
