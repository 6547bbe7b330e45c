"""COUNTER-EXAMPLE. Do not copy: the classic client bug, kept for teaching.

`buggy_pay` looks careful (it retries, it waits between attempts) but it
generates the Idempotency-Key *inside* the retry loop, so every attempt is a
brand-new payment to the server. The seed calls this "the single most common
client bug": it "defeats the entire mechanism".

What it breaks: the first attempt charges the card and the API dies before
answering (crash point after-call-EXT1). The retry carries a fresh key, so the
server cannot recognise it as a retry of that payment. Here the service is
saved only by a second, business-level guard: a client's `reference` may
belong to one live payment at a time, so the retry is refused with 409
duplicate-payment instead of charging the card a second time. The client is
still wrong: it reports an error for an order that was charged, and it has
lost the only key that could have told it the outcome. `python -m
demos.client_bug` shows all of this; `PaymentsClient.pay` is the fix.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from payments_client.client import Event, ProblemError, RetriesExhausted, describe, problem_of


def buggy_pay(
    base_url: str, api_key: str, payment: dict[str, Any], *, attempts: int = 3, wait: float = 1.0,
    timeout: float = 30.0, on_event: Callable[[Event], None] | None = None,
) -> dict[str, Any]:
    """Pay with a retry loop that mints a new key per attempt. THE BUG is marked below."""
    emit = on_event or (lambda event: None)
    operation = payment.get("reference", "payment")
    with httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for attempt in range(1, attempts + 1):
            key = str(uuid.uuid4())  # <-- THE BUG: a fresh key on every attempt, never stored
            emit(Event("key-created", operation, key, attempt))
            try:
                response = http.post(f"{base_url.rstrip('/')}/v1/payments", json=payment,
                                     headers={"Idempotency-Key": key})
            except httpx.TransportError as exc:
                emit(Event("transport-error", operation, key, attempt, detail=describe(exc)))
            else:
                problem = problem_of(response) or {}
                emit(Event("response", operation, key, attempt, status=response.status_code,
                           problem=str(problem.get("type", "")).rsplit("/", 1)[-1] or None,
                           detail=problem.get("detail")))
                if response.status_code < 300:
                    return response.json()
                if response.status_code < 500 and response.status_code != 429:
                    raise ProblemError(response.status_code, problem or {"status": response.status_code})
            if attempt < attempts:
                emit(Event("wait", operation, key, attempt, seconds=wait))
                time.sleep(wait)
    raise RetriesExhausted(f"{operation}: gave up after {attempts} attempts, each with a different key")
