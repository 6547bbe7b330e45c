"""In-memory stand-ins for the database layer and the rails, for the unit tests of decisions.

The real-process tests (tests/integration, tests/crash) prove the protocol
against PostgreSQL and the fake rails running as processes. These fakes let
tests/unit/test_submit_decisions.py and test_runner_decisions.py check each
*decision* of the response matrix (app/machine/matrix.py) and the engine
(app/machine/engine.py), on the payment's machine, in milliseconds. They model only what those decisions read and write:

    FakeDB      one key row and one payment per (client, key), the lease
                token that fences every phase after a claim, and a log of
                every phase called. `install` puts its `atomic`,
                `one_statement` and `read` in place of app.db.transaction's,
                in the two modules that call them (matrix and engine).
    FakeSystem  a PSP or a rail whose calls answer from a script, in order,
                and are recorded. A call nobody scripted fails the test.

Nothing here checks SQL: tests/unit/test_phase_statements.py and the
real-process tests do. Where the fake models a statement it follows that statement's WHERE
clause (app/idempotency/key_table.py), so a decision tested here is tested
against the same rules the database applies.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timezone
from types import SimpleNamespace
from typing import Any

from app.config import Settings
from app.idempotency import key_table
from app.idempotency.keys import derived_key, end_to_end_reference
from app.idempotency.key_table import KeyRow, Lease, LeaseLost
from app.machine import engine, matrix
from app.machine.declare import Operation
from app.payments import phases, submission
from app.payments import payment_table
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.payment import PAYMENT
from app.payments.recovery_points import (
    EXT1_SENT, EXT2_SENT, EXT3_SENT, FINISHED, STEP_CHARGE, STEP_REFUND, STEP_TRANSFER,
)

CLIENT = 1
KEY = "key-1"
STORED_ON = date(2026, 1, 1)  # the day partition every fake key row is in
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
LEGACY_IBAN = "GB82WEST12345698765432"

REQUEST = PaymentRequest.model_validate(
    {
        "amount": 1250,
        "currency": "EUR",
        "reference": "order-1001",
        "card_token": "tok_visa",
        "beneficiary": {"name": "Ada Lovelace", "iban": "DE89370400440532013000"},
    }
)


class UnexpectedCall(BaseException):
    """A call the test did not script or the fake does not model.

    A BaseException, not an Exception: `engine.drive` turns any Exception
    from a step into an unknown outcome, which would hide the surprise.
    """


def settings(**overrides: Any) -> Settings:
    """Settings with every value the decisions read given explicitly.

    pydantic-settings also reads the environment; explicit values win, so a
    PAYMENTS_CRASH_AT or MAX_ATTEMPTS in the shell cannot change a test.
    """
    values: dict[str, Any] = dict(
        database_url="postgresql://x@127.0.0.1:1/x",  # never connected to
        lease_seconds=30.0,
        retry_after_seconds=7,  # not the default 1, so a test sees the setting is used
        max_attempts=3,
        parked_recheck_seconds=300.0,
        backoff_base_seconds=1.0,
        backoff_cap_seconds=300.0,
        payments_crash_at=None,
        rail_legacy=False,
        rail_legacy_accounts="",
    )
    return Settings(**(values | overrides))


def services(psp: FakeSystem | None = None, rail: FakeSystem | None = None, **setting_overrides: Any) -> SimpleNamespace:
    """What the matrix and the engine use of `app.services.Services`; no database engine (FakeDB ignores it)."""
    return SimpleNamespace(
        settings=settings(**setting_overrides), engine=None,
        psp=psp or FakeSystem("psp"), rail=rail or FakeSystem("rail"),
    )


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class FakeSystem:
    """A PSP or a rail: each method answers from its script, in order, and is recorded.

    A script entry is an outcome to return, an exception to raise, or a
    function called then (for a side effect, such as another attempt taking
    the lease over while this one waits on the network) that returns either.
    """

    def __init__(self, name: str, **scripts: list[Any]) -> None:
        self.name = name
        self.scripts = {method: list(outcomes) for method, outcomes in scripts.items()}
        self.calls: list[Call] = []

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    async def _answer(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(Call(method, args, kwargs))
        script = self.scripts.get(method)
        if not script:
            raise UnexpectedCall(f"{self.name}.{method}{args!r} was not scripted")
        outcome = script.pop(0)
        if callable(outcome):
            outcome = outcome()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def charge(self, key: str, payment: Payment) -> Any:
        return await self._answer("charge", key, payment)

    async def find_charge(self, key: str) -> Any:
        return await self._answer("find_charge", key)

    async def refund(self, key: str, payment: Payment, *, amount: int) -> Any:
        return await self._answer("refund", key, payment, amount=amount)

    async def find_refund(self, key: str) -> Any:
        return await self._answer("find_refund", key)

    async def transfer(self, key: str, payment: Payment) -> Any:
        return await self._answer("transfer", key, payment)

    async def find_transfer(self, end_to_end_reference: str) -> Any:
        return await self._answer("find_transfer", end_to_end_reference)

    def deduplicates(self, payment: Payment) -> bool:
        # Synchronous, like app.rails.gateways.Rail.deduplicates: configuration
        # (RAIL_LEGACY_ACCOUNTS), not a call. Payouts to LEGACY_IBAN are legacy.
        return payment.beneficiary_iban != LEGACY_IBAN


@dataclass
class _Key:
    """The columns of one idempotency_key row that the decisions read or write."""

    endpoint: str
    request_hash: bytes
    state: str
    recovery_point: str
    payment_id: uuid.UUID
    token: uuid.UUID | None  # None: nobody holds the lease
    lease_live: bool
    attempts: int
    parked: bool = False
    not_sent: bool = False
    last_error: str | None = None
    response_code: int | None = None
    response_body: str | None = None


class FakeDB:
    """The key table and the payment table as two dicts, and every phase called, in order."""

    def __init__(self) -> None:
        self.keys: dict[tuple[int, str], _Key] = {}
        self.payments: dict[uuid.UUID, Payment] = {}
        self.calls: list[Call] = []
        # Something another actor does right after the named phase commits,
        # once (a reaper deleting the row handler1 did not get, say).
        self.after: dict[str, Callable[[], None]] = {}
        # The phase functions the matrix and the engine pass to atomic,
        # one_statement and read, by identity; anything else is a surprise.
        self._phases = {
            phases.handler1: ("handler1", self._handler1),
            engine.take_over_phase: ("take_over", self._take_over),
            engine.release: ("release", self._release),
            engine.park: ("park", self._park),
            engine.unpark: ("unpark", self._unpark),
            phases.load: ("load payment", self._load_payment),
            phases.record_charge: ("record_charge", self._record_charge),
            phases.record_transfer: ("record_transfer", self._record_transfer),
            phases.record_refund: ("record_refund", self._record_refund),
            key_table.load: ("key_table.load", self._load),
            key_table.claim_recheck: ("key_table.claim_recheck", self._claim_recheck),
            payment_table.get: ("payment_table.get", self._get),
        }

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def called(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # -- what app.db.transaction offers, for monkeypatching ------------------

    async def atomic(self, engine: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run(phase, args, kwargs)

    async def one_statement(self, engine: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run(phase, args, kwargs)

    async def read(self, engine: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run(query, args, kwargs)

    def _run(self, phase: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if phase not in self._phases:
            raise UnexpectedCall(f"phase {phase!r} is not modelled by FakeDB")
        name, model = self._phases[phase]
        self.calls.append(Call(name, args, kwargs))
        result = model(*args, **kwargs)
        if name in self.after:
            self.after.pop(name)()
        return result

    # -- setting up the state a test starts from ------------------------------

    def seed(
        self,
        recovery_point: str = EXT1_SENT,
        *,
        request_hash: bytes | None = None,
        lease_live: bool = False,
        attempts: int = 1,
        parked: bool = False,
        not_sent: bool = False,
        last_error: str | None = None,
        iban: str = REQUEST.beneficiary.iban,
        status: str = "processing",
    ) -> KeyRow:
        """A stored key (ours, of REQUEST unless `request_hash` says otherwise) and its payment, as a caller reads it."""
        payment = _payment(iban=iban, status=status, recovery_point=recovery_point)
        self.payments[payment.id] = payment
        finished = recovery_point == FINISHED
        self.keys[(CLIENT, KEY)] = _Key(
            endpoint=PAYMENT.endpoint,
            request_hash=request_hash if request_hash is not None else submission.fingerprint(REQUEST),
            state="finished" if finished else "started",
            recovery_point=recovery_point,
            payment_id=payment.id,
            token=uuid.uuid4() if lease_live else None,
            lease_live=lease_live,
            attempts=attempts,
            parked=parked,
            not_sent=not_sent,
            last_error=last_error,
            response_code=phases.FINAL_STATUS_CODE if finished else None,
            response_body=PaymentView.of(payment).body() if finished else None,
        )
        return self.row()

    def owned(
        self, recovery_point: str = EXT1_SENT, *, resumed: bool, attempt: int = 1, iban: str = REQUEST.beneficiary.iban
    ) -> Operation:
        """A started key whose live lease this attempt holds: the operation `drive` is handed."""
        self.seed(recovery_point, lease_live=True, attempts=attempt, iban=iban)
        k = self.keys[(CLIENT, KEY)]
        assert k.token is not None
        payment = self.payments[k.payment_id]
        return Operation(PAYMENT, Lease(CLIENT, KEY, k.token, STORED_ON), recovery_point, payment, resumed=resumed, attempt=attempt)

    def steal(self) -> None:
        """Another attempt takes the lease over (ours expired while we waited on the network)."""
        k = self.keys[(CLIENT, KEY)]
        k.token, k.lease_live, k.attempts = uuid.uuid4(), True, k.attempts + 1

    def row(self) -> KeyRow | None:
        return self._load(CLIENT, KEY)

    # -- the phases, each following its statement's WHERE clause ------------

    def _load(self, client_id: int, key: str) -> KeyRow | None:
        k = self.keys.get((client_id, key))
        if k is None:
            return None
        return KeyRow(
            client_id=client_id, key=key, endpoint=k.endpoint, request_hash=k.request_hash, state=k.state,
            recovery_point=k.recovery_point, payment_id=k.payment_id, lease_live=k.lease_live,
            lease_seconds_left=30.0 if k.lease_live else 0.0, attempts=k.attempts, next_attempt_at=NOW,
            parked=k.parked, last_error=k.last_error, response_code=k.response_code,
            response_body=k.response_body, timeline=[], created_at=NOW, updated_at=NOW,
            finished_at=NOW if k.state == "finished" else None,
        )

    def _get(self, client_id: int, payment_id: uuid.UUID) -> Payment | None:
        payment = self.payments.get(payment_id)
        return payment if payment is not None and payment.client_id == client_id else None

    def _load_payment(self, row: KeyRow) -> Payment:
        return self.payments[row.payment_id]

    def _handler1(
        self, machine: Any, *, client_id: int, key: str, request_hash: bytes, request: PaymentRequest, lease_seconds: float
    ) -> Operation | None:
        # INSERT ... ON CONFLICT DO NOTHING: an existing key, whoever wrote it, means no row.
        if (client_id, key) in self.keys:
            return None
        payment = _payment(recovery_point=EXT1_SENT)
        self.payments[payment.id] = payment
        token = uuid.uuid4()
        self.keys[(client_id, key)] = _Key(
            endpoint=machine.endpoint, request_hash=request_hash, state="started", recovery_point=EXT1_SENT,
            payment_id=payment.id, token=token, lease_live=True, attempts=1,
        )
        return Operation(machine, Lease(client_id, key, token, STORED_ON), EXT1_SENT, payment, resumed=False)

    def _take_over(self, machines: Any, client_id: int, key: str, lease_seconds: float) -> Operation | None:
        # Only a started, unparked row whose lease has run out; not_sent is read and reset.
        k = self.keys.get((client_id, key))
        if k is None or k.state != "started" or k.parked or k.lease_live:
            return None
        not_sent, k.not_sent = k.not_sent, False
        k.token, k.lease_live, k.attempts = uuid.uuid4(), True, k.attempts + 1
        return Operation(
            machines[k.endpoint], Lease(client_id, key, k.token, STORED_ON), k.recovery_point, self.payments[k.payment_id],
            resumed=not not_sent, attempt=k.attempts,
        )

    def _fence(self, lease: Lease) -> _Key:
        k = self.keys.get((lease.client_id, lease.key))
        if k is None or k.state != "started" or k.token != lease.token:
            raise LeaseLost(f"lease on {lease.key!r} was taken over; this attempt must stop")
        return k

    def _release(self, op: Operation, reason: str, retry_in: float, *, event: str = "", not_sent: bool = False) -> None:
        k = self._fence(op.lease)
        k.token, k.lease_live, k.last_error, k.not_sent = None, False, reason, not_sent

    def _park(self, op: Operation, reason: str, recheck_in: float, *, not_sent: bool = False) -> Payment:
        k = self._fence(op.lease)
        k.token, k.lease_live, k.parked, k.last_error, k.not_sent = None, False, True, reason, not_sent
        return self._set_payment(k, status="indeterminate")

    def _claim_recheck(self, client_id: int, key: str, recheck_in: float) -> tuple[str, uuid.UUID] | None:
        # Every parked row counts as due: when it is due is the database's business, not a decision here.
        k = self.keys.get((client_id, key))
        if k is None or k.state != "started" or not k.parked:
            return None
        return k.recovery_point, k.payment_id

    def _unpark(self, machine: Any, client_id: int, key: str, lease_seconds: float, *, event: str) -> Operation | None:
        k = self.keys.get((client_id, key))
        if k is None or k.state != "started" or not k.parked:
            return None
        k.parked, k.not_sent = False, False
        k.token, k.lease_live, k.attempts = uuid.uuid4(), True, k.attempts + 1
        payment = self._set_payment(k, status="processing")
        return Operation(machine, Lease(client_id, key, k.token, STORED_ON), k.recovery_point, payment, resumed=True, attempt=k.attempts)

    def _record_charge(self, op: Operation, charge: Any, lease_seconds: float) -> Operation:
        k = self._fence(op.lease)
        if charge.status == "declined":
            return self._finish(k, op, status="declined", psp_charge_id=charge.id, decline_code=charge.decline_code)
        return self._advance(
            k, op, EXT2_SENT, psp_charge_id=charge.id, end_to_end_reference=end_to_end_reference(CLIENT, KEY),
            rail_transfer_key=derived_key(CLIENT, KEY, STEP_TRANSFER),
        )

    def _record_transfer(self, op: Operation, transfer: Any, lease_seconds: float) -> Operation:
        k = self._fence(op.lease)
        if transfer.status == "accepted":
            return self._finish(k, op, status="succeeded", rail_transfer_id=transfer.id)
        return self._advance(
            k, op, EXT3_SENT, rail_transfer_id=transfer.id, reject_reason=transfer.reject_reason,
            psp_refund_key=derived_key(CLIENT, KEY, STEP_REFUND),
        )

    def _record_refund(self, op: Operation, refund: Any, lease_seconds: float) -> Operation:
        k = self._fence(op.lease)
        return self._finish(k, op, status="failed", psp_refund_id=refund.id)

    def _advance(self, k: _Key, op: Operation, recovery_point: str, **payment: Any) -> Operation:
        k.recovery_point, k.last_error = recovery_point, None
        return replace(op, recovery_point=recovery_point, subject=self._set_payment(k, **payment), resumed=False)

    def _finish(self, k: _Key, op: Operation, **payment: Any) -> Operation:
        final = self._set_payment(k, **payment)
        k.state, k.recovery_point, k.token, k.lease_live, k.last_error = "finished", FINISHED, None, False, None
        k.response_code, k.response_body = phases.FINAL_STATUS_CODE, PaymentView.of(final).body()
        return replace(op, recovery_point=FINISHED, subject=final, response=(k.response_code, k.response_body))

    def _set_payment(self, k: _Key, **values: Any) -> Payment:
        payment = replace(self.payments[k.payment_id], **values)
        self.payments[k.payment_id] = payment
        return payment


def install(monkeypatch: Any) -> FakeDB:
    """A FakeDB in place of the transaction functions, where the matrix and the engine look them up."""
    db = FakeDB()
    for module in (matrix, engine):
        for name in ("atomic", "one_statement", "read"):
            if hasattr(module, name):  # the matrix takes over through the engine: no `atomic` of its own
                monkeypatch.setattr(module, name, getattr(db, name))
    return db


def _payment(
    *, iban: str = REQUEST.beneficiary.iban, status: str = "processing", recovery_point: str = EXT1_SENT
) -> Payment:
    """A payment row as it stands at `recovery_point`: the derived keys it has by then."""
    past_charge = recovery_point in (EXT2_SENT, EXT3_SENT, FINISHED)
    return Payment(
        id=uuid.uuid4(), client_id=CLIENT, reference=REQUEST.reference, amount_minor=REQUEST.amount,
        currency=REQUEST.currency, fee_minor=fee_for(REQUEST.amount),
        net_minor=REQUEST.amount - fee_for(REQUEST.amount), card_token=REQUEST.card_token,
        beneficiary_name=REQUEST.beneficiary.name, beneficiary_iban=iban, status=status,
        end_to_end_reference=end_to_end_reference(CLIENT, KEY) if past_charge else None,
        psp_charge_key=derived_key(CLIENT, KEY, STEP_CHARGE),
        psp_charge_id="ch_1" if past_charge else None, decline_code=None,
        rail_transfer_key=derived_key(CLIENT, KEY, STEP_TRANSFER) if past_charge else None,
        rail_transfer_id=None, reject_reason=None,
        psp_refund_key=derived_key(CLIENT, KEY, STEP_REFUND) if recovery_point == EXT3_SENT else None,
        psp_refund_id=None, created_at=NOW, updated_at=NOW, payout_instructed_at=NOW if past_charge else None,
    )
