"""docs/operations.md lists exactly the metrics the code defines: names, types and labels.

An operator builds dashboards and alerts from that page. A metric added in
the code and not on the page is invisible to them; one on the page that the
code no longer exports is an alert that can never fire. So the table is
checked against app/observability/metrics.py's registry (the worker's
metrics included), row by row.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operations.md"
ROW = re.compile(r"^\| `(payments_\w+)` \| (counter|gauge|histogram) \|([^|]*)\|", re.MULTILINE)


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    rows = ROW.findall(PAGE.read_text())
    table = {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert len(table) == len(rows), "a metric is listed twice"
    return table


def defined() -> dict[str, tuple[str, frozenset[str]]]:
    metrics.worker()  # registered lazily, in the worker process; here, to be listed
    found = {}
    for family in metrics.REGISTRY.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for s in family.samples for label in s.labels if label != "le"}
        found[name] = (family.type, frozenset(labels))
    return found


def test_the_operations_page_lists_exactly_the_metrics_the_code_defines():
    assert set(documented()) == set(defined())


def test_each_metric_has_the_type_and_labels_the_page_gives():
    # Families with labels but no series yet have no samples to read labels
    # from; their label names come from the metric objects themselves.
    code = defined()
    for wrapper in _metric_objects():
        name = wrapper._name + "_total" if wrapper._type == "counter" else wrapper._name
        code[name] = (code[name][0], frozenset(wrapper._labelnames))
    assert documented() == code


def _metric_objects():
    worker = metrics.worker()
    objects = [getattr(metrics, n) for n in dir(metrics)] + [getattr(worker, f) for f in worker.__dataclass_fields__]
    return [o for o in objects if hasattr(o, "_labelnames") and hasattr(o, "_type") and o._labelvalues == ()]
