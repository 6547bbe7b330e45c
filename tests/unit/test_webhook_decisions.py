"""What the dispatcher does after each attempt (app/outbox/delivery.py::decide), and what it signs.

Pure functions: the schedule, the give-up, Retry-After within the cap, and a
signature the receiver's copy of the library accepts.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from app.outbox import delivery, egress
from app.outbox.delivery import Answer, Claimed
from app.outbox.egress import EgressPolicy
from app.outbox.endpoints import InvalidWebhookUrl, checked_url, new_secret

SCHEDULE = dict(max_attempts=5, base=10.0, cap=60.0)


def failed(status: int | None = 500, error_class: str = "http_status", retry_after: float | None = None) -> Answer:
    return Answer(status, 12.0, error_class, "boom", retry_after)


def test_a_2xx_is_delivered_whatever_the_attempt():
    assert delivery.decide(Answer(204, 3.0, None), 5, **SCHEDULE).outcome == delivery.DELIVERED


@pytest.mark.parametrize("answer", [failed(500), failed(404), failed(401), failed(None, "timeout"), failed(None, "connection")])
def test_every_failure_is_retried_until_the_last_attempt_then_dead(answer):
    assert [delivery.decide(answer, n, **SCHEDULE).outcome for n in range(1, 6)] == ["retry"] * 4 + ["dead"]


def test_the_wait_doubles_with_jitter_and_stops_at_the_cap():
    for attempt, ceiling in [(1, 10), (2, 20), (3, 40), (4, 60)]:
        waits = [delivery.decide(failed(), attempt, **SCHEDULE).retry_in for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (attempt, min(waits), max(waits))
        assert max(waits) - min(waits) > ceiling / 10, "jittered, not all at once"


@pytest.mark.parametrize("status, retry_after, expected", [(429, 45.0, 45.0), (503, 45.0, 45.0), (429, 3600.0, 60.0)])
def test_retry_after_is_honoured_within_the_cap(status, retry_after, expected):
    decision = delivery.decide(failed(status, "rate_limited", retry_after), 1, **SCHEDULE)
    assert decision.outcome == delivery.RETRY and decision.retry_in == expected


def test_no_endpoint_cancels():
    assert delivery.decide(None, 1, **SCHEDULE).outcome == delivery.CANCELLED


def test_the_documented_default_schedule_retries_for_about_one_to_two_days():
    longest = sum(delivery.schedule(16, 30.0, 21600.0))
    assert 36 * 3600 < longest < 40 * 3600 and 18 * 3600 < longest / 2


def test_a_signed_delivery_verifies_with_the_library_on_the_receivers_side():
    secret = new_secret()
    claimed = Claimed(
        event_id=uuid.uuid4(), client_id=1, attempt=1, due_attempt=1, lease_token=uuid.uuid4(),
        url="http://merchant.test/webhooks", secret=secret, type="payment.succeeded",
        data='{"id": "p", "status": "succeeded"}', created_at=datetime(2026, 12, 2, tzinfo=UTC),
    )
    body = claimed.body()
    signed = delivery.signed_headers(claimed, body, datetime.now(UTC))

    assert signed["webhook-id"] == str(claimed.event_id)
    assert Webhook(secret).verify(body, signed) == {
        "type": "payment.succeeded", "timestamp": "2026-12-02T00:00:00Z", "data": {"id": "p", "status": "succeeded"},
    }
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, signed)
    stale = delivery.signed_headers(claimed, body, datetime.now(UTC) - timedelta(minutes=10))
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, stale)


def first_attempt(client_id: int, events_per_post: int = 1, secret: str = "whsec_x", n: int = 0) -> Claimed:
    return Claimed(
        event_id=uuid.uuid4(), client_id=client_id, attempt=1, due_attempt=1, lease_token=uuid.uuid4(),
        url=f"http://merchant.test/{client_id}", secret=secret, type="payment.succeeded",
        data=f'{{"id": "p{n}", "status": "succeeded"}}', created_at=datetime(2026, 12, 2, 0, 0, n, tzinfo=UTC),
        events_per_post=events_per_post,
    )


def test_a_batch_goes_out_in_lists_of_each_endpoints_size_in_its_order_and_every_other_event_alone():
    a = [first_attempt(1, events_per_post=3) for _ in range(7)]
    b = [first_attempt(2) for _ in range(2)]
    c = [first_attempt(3, events_per_post=10) for _ in range(2)]
    batch = [a[0], b[0], a[1], c[0], a[2], a[3], b[1], a[4], c[1], a[5], a[6]]

    posts = delivery.together(batch)

    assert posts == [a[0:3], [b[0]], c, a[3:6], [b[1]], [a[6]]]
    assert [e for post in posts for e in post if e.client_id == 1] == a, "each endpoint's events keep their order"


def test_a_list_post_verifies_with_the_library_and_carries_each_event_with_its_id():
    secret = new_secret()
    events = [first_attempt(1, events_per_post=5, secret=secret, n=n) for n in range(3)]
    body = delivery.list_body(events)
    signed = delivery.signed_headers(events[0], body, datetime.now(UTC), message_id=delivery.list_id(events))

    assert Webhook(secret).verify(body, signed) == {
        "type": "event.list", "timestamp": "2026-12-02T00:00:02Z",
        "data": {"events": [
            {"id": str(e.event_id), "type": "payment.succeeded", "timestamp": f"2026-12-02T00:00:0{n}Z",
             "data": {"id": f"p{n}", "status": "succeeded"}}
            for n, e in enumerate(events)
        ]},
    }
    # The id is the list's: the same events in the same order, the same id; any other list, another.
    assert signed["webhook-id"] == delivery.list_id(list(events)) != delivery.list_id(events[:2])
    assert delivery.list_id(events) != delivery.list_id(events[::-1])
    assert signed["webhook-id"].startswith("list_")


@pytest.mark.parametrize("url", ["ftp://x/y", "/webhooks", "http://", "merchant.test/webhooks"])
def test_only_absolute_http_urls_are_webhook_endpoints(url):
    for policy in (EgressPolicy(), egress.development()):
        with pytest.raises(InvalidWebhookUrl):
            checked_url(url, policy)
