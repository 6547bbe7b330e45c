"""The load generator: N concurrent clients for a fixed time, in this process.

It is as light as we can make it in Python, because on a 2-core machine it
competes for the same CPUs as the system it measures (the CPU table shows
what it took): aiohttp's client, one keep-alive connection per concurrent
client, the body from devtools/bodies.py (json.dumps per request, a few
microseconds), uvloop when it is installed.

Each client sends request after request until the deadline, never starting
one after it; the rate is taken over the time until the last one finished,
so no request is cut off and none is in flight when the run's figures are
read.

A session's first run (the warm-up) starts its clients 10 ms apart, so their
keep-alive connections arrive one by one, as real clients' do. A connection
stays with the worker process that accepted it until the server closes it:
`payments api --workers N` gives each worker a listening socket of its own,
the kernel chooses one per connection, and a worker holding more than its
share closes the excess after an answer, which aiohttp opens again
(app/fastpath/reuse_port.py). The bench reports how the API's CPU was split
between its workers in every round (the busiest ÷ the idlest is a target),
so a skew shows; and, to tell a worker that served more from one that spent
more on each answer, how many answers each served: the clients count their
answers by the local port of the connection that carried them, and the
bench maps those ports to the worker holding each connection at the end.

Only the answer the test expects counts as a success, and latency is
measured for successes only:

new payment
    a fresh Idempotency-Key (uuid4) and a fresh reference every time;
    success is 201 Created.
replay
    a retry of a payment that finished: the same key and the same body
    again, round robin over up to 1000 of them; success is the stored 201,
    byte for byte, with `Idempotent-Replayed: true`.
refund
    a partial refund (REFUND_MINOR) of a payment that finished, with a fresh
    Idempotency-Key and a fresh reference, the payments in turn
    (`refund_order`: each once, then each again, while the charge has room);
    the clients stop early if nothing is left to refund. Success is 201
    with `"status": "succeeded"` (the fake PSP refunds at once when no fault
    is planned; a 202 `pending` or a `failed` refund is counted as not one).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from devtools import bodies

PATH = "/v1/payments"
REFUNDS_PATH = "/v1/payments/{payment_id}/refunds"
# Of the body's 12.50: a partial refund, so the payment stays refundable and
# the reservation is the conditional write a real partial refund makes.
REFUND_MINOR = 100
RAMP_SECONDS = 0.01  # between the clients' first requests, in a session's first run


def payment_body(reference: str) -> bytes:
    """The one payment body (devtools/bodies.py), encoded once per request."""
    return json.dumps(bodies.payment_body(reference)).encode()


@dataclass(frozen=True)
class Paid:
    """A payment that got its 201: what a replay must send, and get back."""

    key: str
    reference: str
    body: bytes
    response: bytes


@dataclass(frozen=True)
class Refunded:
    """A refund that got its 201 `succeeded`: what the refund check looks for in the databases."""

    key: str
    reference: str
    payment_id: str
    amount: int
    response: bytes


def refund_order(payments: list[Paid]) -> Iterator[Paid]:
    """The payments to refund, REFUND_MINOR each: every one in turn, then every one again, as many
    times as the charge has room for.

    Each comes back only after all the others, so two refunds of one payment
    are in flight together only if there are fewer payments than clients:
    refunds of one payment wait for each other on its row lock, which the
    integration tests exercise and a rate should not measure.
    """
    passes = bodies.payment_body()["amount"] // REFUND_MINOR
    return itertools.chain.from_iterable(itertools.repeat(payments, passes))


def payment_id_of(paid: Paid) -> str:
    """The payment's id, from the 201 its client got."""
    return json.loads(paid.response)["id"]


@dataclass
class RunResult:
    """What the clients saw in one timed run."""

    latencies: list[float] = field(default_factory=list)  # seconds, successes only
    statuses: Counter[str] = field(default_factory=Counter)
    paid: list[Paid] = field(default_factory=list)  # new payments that got their 201
    references: list[str] = field(default_factory=list)  # every new payment or refund sent, answered or not
    elapsed: float = 0.0
    refunded: list[Refunded] = field(default_factory=list)  # refunds that got their 201 succeeded
    # Answers (any status) by the client's own port of the connection that
    # carried them: which API worker served how many (bench/costs.py::CpuMeter.workers).
    answered: Counter[int | None] = field(default_factory=Counter)

    @property
    def succeeded(self) -> int:
        return len(self.latencies)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def per_second(self) -> float:
        return self.succeeded / self.elapsed if self.elapsed else 0.0

    @property
    def failed(self) -> int:
        return self.requests - self.succeeded

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "elapsed_s": round(self.elapsed, 3),
            "per_second": round(self.per_second, 1),
            "latency_ms": latency_ms(ordered),
            "statuses": dict(sorted(self.statuses.items())),
        }


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted seconds, in milliseconds."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000


def latency_ms(ordered: list[float]) -> dict[str, float | None]:
    figures = {
        "p50": percentile(ordered, 0.50),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1] * 1000 if ordered else None,
        "mean": sum(ordered) / len(ordered) * 1000 if ordered else None,
    }
    return {k: None if v is None else round(v, 2) for k, v in figures.items()}


Request = Callable[[RunResult], Awaitable[None]]


class PortedResponse(aiohttp.ClientResponse):
    """aiohttp's response, remembering the local port of the connection it came on.

    Read as the answer starts: a short answer arrives whole with its
    headers, and aiohttp gives its connection back to the pool before the
    caller could ask for it.
    """

    client_port: int | None = None

    async def start(self, connection: aiohttp.connector.Connection) -> PortedResponse:
        transport = connection.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        self.client_port = sockname[1] if sockname else None
        await super().start(connection)
        return self


class _Exhausted(Exception):
    """A request had nothing left to send: its client stops before the deadline."""


class Load:
    """`concurrency` clients against one API, over one aiohttp session."""

    def __init__(self, base_url: str, api_key: str, concurrency: int) -> None:
        self.base_url, self.api_key, self.concurrency = base_url, api_key, concurrency
        self.connected = False  # whether the clients' connections are open (after the first run)
        self.answered: Counter[int | None] = Counter()  # the current run's, by client port

    async def __aenter__(self) -> Load:
        self.session = aiohttp.ClientSession(
            base_url=self.base_url,
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            response_class=PortedResponse,
            headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=60),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def run(self, request: Request, duration: float) -> RunResult:
        """Every client sends `request` after `request` until the deadline."""
        result = RunResult()
        self.answered = result.answered
        deadline = time.monotonic() + duration

        async def client(number: int) -> None:
            if not self.connected:
                await asyncio.sleep(number * RAMP_SECONDS)
            while time.monotonic() < deadline:
                try:
                    await request(result)
                except _Exhausted:  # nothing left to send (refunds: every charge refunded to its end)
                    return

        started = time.perf_counter()
        await asyncio.gather(*(client(n) for n in range(self.concurrency)))
        result.elapsed = time.perf_counter() - started
        self.connected = True
        return result

    async def _post(self, key: str, body: bytes, path: str = PATH) -> tuple[str | int, bool, bytes, float]:
        """(status or error, Idempotent-Replayed?, body, seconds)."""
        started = time.perf_counter()
        try:
            async with self.session.post(path, data=body, headers={"Idempotency-Key": key}) as response:
                self.answered[response.client_port] += 1
                content = await response.read()
                replayed = response.headers.get("Idempotent-Replayed") == "true"
                return response.status, replayed, content, time.perf_counter() - started
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"error: {type(exc).__name__}", False, b"", time.perf_counter() - started

    async def new_payment(self, result: RunResult) -> None:
        key, reference = str(uuid.uuid4()), f"bench-{uuid.uuid4().hex}"
        body = payment_body(reference)
        result.references.append(reference)
        status, _, content, elapsed = await self._post(key, body)
        result.statuses[str(status)] += 1
        if status == 201:
            result.latencies.append(elapsed)
            result.paid.append(Paid(key, reference, body, content))

    def replayer(self, paid: list[Paid]) -> Request:
        cycle = itertools.cycle(paid)

        async def replay(result: RunResult) -> None:
            original = next(cycle)
            status, replayed, content, elapsed = await self._post(original.key, original.body)
            if status != 201:
                result.statuses[str(status)] += 1
            elif not replayed:
                result.statuses["201 without Idempotent-Replayed: true (wrong)"] += 1
            elif content != original.response:
                result.statuses["201 with a different body (wrong)"] += 1
            else:
                result.statuses["201 replayed"] += 1
                result.latencies.append(elapsed)

        return replay

    def refunder(self, payments: Iterator[Paid]) -> Request:
        """A partial refund of each payment `payments` yields, the iterator shared by the clients (and
        by the runs of a session: the measured run goes on where the warm-up stopped)."""

        async def refund(result: RunResult) -> None:
            paid = next(payments, None)
            if paid is None:
                raise _Exhausted
            key, reference, payment_id = str(uuid.uuid4()), f"bench-refund-{uuid.uuid4().hex}", payment_id_of(paid)
            body = json.dumps({"amount": REFUND_MINOR, "reference": reference}).encode()
            result.references.append(reference)
            status, _, content, elapsed = await self._post(key, body, REFUNDS_PATH.format(payment_id=payment_id))
            if status == 201 and json.loads(content).get("status") == "succeeded":
                result.statuses["201 succeeded"] += 1
                result.latencies.append(elapsed)
                result.refunded.append(Refunded(key, reference, payment_id, REFUND_MINOR, content))
            elif status in (201, 202):
                result.statuses[f"{status} {json.loads(content).get('status')}"] += 1
            else:
                result.statuses[str(status)] += 1

        return refund

    async def new_payments(self, duration: float) -> RunResult:
        return await self.run(self.new_payment, duration)

    async def replays(self, paid: list[Paid], duration: float) -> RunResult:
        return await self.run(self.replayer(paid), duration)

    async def refunds(self, payments: Iterator[Paid], duration: float) -> RunResult:
        return await self.run(self.refunder(payments), duration)
