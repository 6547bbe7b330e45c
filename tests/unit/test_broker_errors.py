"""The batch consumer's and publisher's log lines about a failed broker request say what failed.

app/broker/jetstream.py::describe words the two errors a node killed in
`make cluster` brings (docs/batches.md#a-three-node-cluster): JetStream's bare
"unavailable" answer, which nats-py prints as `code=None err_code=None
description='None'`, and nats-py's request timeout, whose chain ends in
asyncio's CancelledError (the innermost error, which the database's
describe would name).
"""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors

from app.broker import jetstream
from app.db import errors


def caught(raising) -> BaseException:
    try:
        raising()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


async def request_timing_out() -> None:
    """What nats-py's request does when no answer comes in time (nats/aio/client.py)."""
    try:
        await asyncio.wait_for(asyncio.Event().wait(), 0.001)  # an answer that never comes
    except asyncio.TimeoutError:
        raise nats.errors.TimeoutError  # its context: asyncio's timeout, and beneath that the cancellation


def test_an_unavailable_answer_says_no_leader_not_its_empty_fields():
    line = jetstream.describe(nats.js.errors.ServiceUnavailableError())
    assert line.startswith("ServiceUnavailableError: no leader for the stream or the durable consumer"), line
    assert "None" not in line


def test_a_request_timed_out_is_named_a_timeout_not_the_cancellation_beneath_it():
    exc = caught(lambda: asyncio.run(request_timing_out()))
    assert errors.describe(exc) == "CancelledError"  # what the lines said before
    assert jetstream.describe(exc) == "TimeoutError: nats: timeout"


def test_any_other_error_is_its_name_and_the_first_line_of_its_message():
    assert jetstream.describe(nats.errors.NoRespondersError()) == (
        "NoRespondersError: nats: no responders available for request")
    assert jetstream.describe(ConnectionRefusedError(111, "Connection refused")) == (
        "ConnectionRefusedError: [Errno 111] Connection refused")
    assert jetstream.describe(RuntimeError("first\nsecond")) == "RuntimeError: first"
