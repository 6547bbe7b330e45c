"""How bench/fake_keys.py weighs a key form: each fake charged to the form it got that round, the forms swapped."""

from __future__ import annotations

from bench.fake_keys import forms_of, round_figures, summary
from bench.sessions import Mark


def _marks() -> tuple[Mark, Mark]:
    # Fake A spends 0.5 s in its process and 0.25 s in its session; fake B 0.25 s and 0.125 s.
    # Each is woken 50 times.
    before = Mark(processes={"A": {1: 1.0}, "B": {2: 1.0}}, woken={"A": {1: 0}, "B": {2: 10}},
                  sessions={10: 1.0, 11: 1.0}, owner={10: "A", 11: "B"})
    after = Mark(processes={"A": {1: 1.5}, "B": {2: 1.25}}, woken={"A": {1: 50}, "B": {2: 60}},
                 sessions={10: 1.25, 11: 1.125}, owner={10: "A", 11: "B"})
    return before, after


def test_the_forms_swap_between_the_fakes_every_round():
    assert [forms_of(r)["A"] for r in range(4)] == ["hex", "uuid", "hex", "uuid"]
    assert all(set(forms_of(r).values()) == {"hex", "uuid"} for r in range(4))


def test_each_fake_is_charged_to_the_form_it_got_with_its_sessions():
    even = round_figures(*_marks(), forms_of(0), {"A": 500, "B": 250})
    odd = round_figures(*_marks(), forms_of(1), {"A": 500, "B": 250})

    assert (even["hex"]["process_ms"], even["hex"]["sessions_ms"]) == (1.0, 0.5)
    assert (even["uuid"]["process_ms"], even["uuid"]["sessions_ms"]) == (1.0, 0.5)
    assert even["ratio"] == 1.0, "the same CPU a charge, though B charged half as many"
    assert odd["uuid"]["charges"] == 500 and odd["hex"]["charges"] == 250
    assert (even["hex"]["woken"], even["uuid"]["woken"]) == (0.1, 0.2)


def test_the_figure_is_the_median_of_the_rounds_ratios():
    rounds = [{"ratio": r} for r in (1.1, 0.9, 1.0, 1.3)]

    figures = summary(rounds)

    assert figures["ratio"] == 1.05 and (figures["lowest"], figures["highest"]) == (0.9, 1.3)
