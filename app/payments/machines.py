"""Every operation's machine, by the endpoint its key rows store.

The recovery worker and the re-probe of parked operations find a key row,
not a request: its stored endpoint says which machine drives it.
"""

from __future__ import annotations

from typing import Any

from app.machine.declare import Machine
from app.payments.payment import PAYMENT
from app.payments.refunds.refund import REFUND
from app.payments.returns import RETURN_REFUND

BY_ENDPOINT: dict[str, Machine[Any]] = {machine.endpoint: machine for machine in (PAYMENT, RETURN_REFUND, REFUND)}
