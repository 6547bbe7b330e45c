"""Structured logs: one JSON object per line, each carrying the payment it is about.

Where it sits: a leaf below every layer. The service logs through the
standard library (`logging.getLogger(__name__)` in each module); this module
says where those records go and how they are written (`dict_config`,
`configure`: LOG_FORMAT json or console, LOG_LEVEL for `app.*` only).
Whoever learns a payment's fields binds them in the task's context (`bind`;
`payment_scope` for a loop over several payments), and every line logged
after that in the task carries them. docs/operations.md#logs lists the
fields, what is never logged, and what is logged at which level.
"""

from __future__ import annotations

import hashlib
import logging
import logging.config
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.orjson import OrjsonFormatter

FORMATS = ("json", "console")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# The payment's fields for the current task; a new dict on every change, so
# a task that inherited it (asyncio copies the context) never sees ours.
_FIELDS: ContextVar[dict[str, Any]] = ContextVar("payment_log_fields", default={})


class PaymentFields(logging.Filter):
    """Puts the task's bound fields on every record the handler writes."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _FIELDS.get()
        if fields:
            record.__dict__.update(fields)
        return True


# What a record carries that is not one of the fields logged by name.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class ConsoleFormatter(logging.Formatter):
    """`time level logger: message  name=value ...`: the JSON line's content, for reading."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _RECORD_ATTRIBUTES)
        return f"{line}  {fields}" if fields else line


def formatter(log_format: str = "json") -> logging.Formatter:
    """The formatter for LOG_FORMAT (named in `dict_config`, so uvicorn's workers build it too).

    Built once in every process that logs (uvicorn's spawned workers start
    afresh), so that is where the standard library's switches are set too.
    """
    skip_unused_record_attributes()
    if log_format == "console":
        return ConsoleFormatter()
    # An exception's traceback becomes one string field: still one line.
    # orjson encodes it: python-json-logger's own formatter for it, cheaper
    # than the standard library's encoder for the line every payment logs.
    return OrjsonFormatter(
        ["levelname", "name", "message"],
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp=True,
    )


def dict_config(log_format: str, level: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` for LOG_FORMAT and LOG_LEVEL.

    `payments api` hands it to uvicorn, which applies it in every worker
    process it starts; `payments worker` and `payments reconcile` apply it
    themselves (`configure`).
    """
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"payments": {"()": f"{__name__}.formatter", "log_format": log_format}},
        "filters": {"payment": {"()": f"{__name__}.PaymentFields"}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "payments", "filters": ["payment"],
                       "stream": "ext://sys.stderr"},
        },
        "root": {"handlers": ["stderr"], "level": "WARNING"},
        "loggers": {"app": {"level": level}},
    }


def configure(log_format: str, level: str) -> None:
    logging.config.dictConfig(dict_config(log_format, level))


def skip_unused_record_attributes() -> None:
    """The standard library's documented switches for what no line of ours shows.

    Finding the caller's file and line walks the stack on every record, and
    a line names its logger instead; thread and process names are the same
    on every line of a process.
    """
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def key_hash(key: str) -> str:
    """A short, stable stand-in for an Idempotency-Key in a log line (12 hex digits of its SHA-256).

    Enough to follow one key's lines and to find them from the key
    (`printf %s KEY | sha256sum | cut -c1-12`); the key itself may be
    anything a client chose to put in it.
    """
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def bind(**fields: Any) -> None:
    """Stamp every later line of this task with `fields` (the payment's, see the module docstring)."""
    _FIELDS.set(_FIELDS.get() | fields)


def bound() -> dict[str, Any]:
    """What the current task has bound (for tests, and for a line that wants to say it)."""
    return dict(_FIELDS.get())


@contextmanager
def payment_scope() -> Iterator[None]:
    """Whatever is bound inside is forgotten at the end: for a loop over several payments in one task."""
    token = _FIELDS.set(_FIELDS.get())
    try:
        yield
    finally:
        _FIELDS.reset(token)
