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


@pytest.mark.parametrize("url", ["ftp://x/y", "/webhooks", "http://", "merchant.test/webhooks"])
def test_only_absolute_http_urls_are_webhook_endpoints(url):
    for policy in (EgressPolicy(), egress.development()):
        with pytest.raises(InvalidWebhookUrl):
            checked_url(url, policy)
