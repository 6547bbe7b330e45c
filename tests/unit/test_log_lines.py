"""A log line is one JSON object on one line, with the task's payment fields, whatever it carries.

app/observability/logs.py formats every record with python-json-logger's
orjson formatter. What must hold for whoever reads the log with a JSON
parser, one line at a time: the level, logger, message and timestamp under
the names docs/operations.md#logs gives, the fields bound in the task on
the line, an exception's traceback as one string field (a line break in the
output would split one record into lines no parser reads), and a value
that JSON has no type for (a Decimal amount, a UUID, a date) written as a
string instead of losing the line.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from datetime import date
from decimal import Decimal

from app.observability import logs


def lines_of(emit) -> list[str]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.formatter("json"))
    handler.addFilter(logs.PaymentFields())
    logger = logging.getLogger("app.test_log_lines")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_a_line_carries_the_bound_fields_and_whatever_json_has_no_type_for():
    token = uuid.uuid4()

    def emit(logger: logging.Logger) -> None:
        with logs.payment_scope():
            logs.bind(client_id=7, key_hash=logs.key_hash("k-1"), lease_token=token, amount=Decimal("12.50"),
                      day=date(2026, 12, 7))
            logger.info("%s finished: %s", "payment", "succeeded")

    [line] = lines_of(emit)
    record = json.loads(line)
    assert {k: record[k] for k in ("level", "logger", "message")} == {
        "level": "INFO", "logger": "app.test_log_lines", "message": "payment finished: succeeded"}
    assert record["timestamp"].endswith("+00:00")
    assert (record["client_id"], record["key_hash"]) == (7, logs.key_hash("k-1"))
    assert (record["lease_token"], record["amount"], record["day"]) == (str(token), "12.50", "2026-12-07")


def test_a_traceback_is_one_field_of_one_line():
    def emit(logger: logging.Logger) -> None:
        try:
            raise ValueError("the rail answered nonsense")
        except ValueError:
            logger.exception("could not read the answer")

    [line] = lines_of(emit)
    record = json.loads(line)
    assert record["level"] == "ERROR"
    assert "Traceback" in record["exc_info"] and "ValueError: the rail answered nonsense" in record["exc_info"]
