"""What the fake merchant logs of each POST before it verifies it (fake_rails/merchant.py::peek).

Its log of POSTs (`fake_merchant.received`) is evidence in the list tests
(tests/crash/test_webhook_lists.py): how many events each POST carried.
"""

from __future__ import annotations

import json

from fake_rails.merchant import LIST_TYPE, peek


def envelope(data: dict) -> dict:
    return {"type": "payment.succeeded", "timestamp": "2026-12-05T00:00:00Z", "data": data}


def test_a_list_counts_every_event_it_carries_those_of_no_payment_too():
    """Bug caught: the count taken from the references, so that a list of a batch's events,
    which name no payment, is logged as one event."""
    items = [{"id": "e1", **envelope({"reference": "r1"})},
             {"id": "e2", "type": "batch.completed", "timestamp": "2026-12-05T00:00:00Z", "data": {"batch_id": "b"}},
             {"id": "e3", **envelope({"reference": "r3"})}]
    body = json.dumps({"type": LIST_TYPE, "timestamp": "2026-12-05T00:00:00Z", "data": {"events": items}})

    assert peek(body.encode()) == (3, ["r1", "r3"])


def test_one_event_is_one_and_a_body_that_cannot_be_read_counts_as_one_with_no_reference():
    assert peek(json.dumps(envelope({"reference": "r1"})).encode()) == (1, ["r1"])
    assert peek(b"not json") == (1, [])
