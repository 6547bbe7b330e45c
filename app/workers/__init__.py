"""Background work beside the API: the recovery sweep and reconciliation (`payments worker`)."""

import asyncio
import random

# The longest a worker loop waits before trying the database again after a
# failed pass: long enough not to hammer a server that is restarting, short
# enough that work resumes soon after it is back.
OUTAGE_BACKOFF_CAP_SECONDS = 30.0


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less if `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def outage_backoff(failures: int, base: float, cap: float = OUTAGE_BACKOFF_CAP_SECONDS) -> float:
    """How long to wait after `failures` passes in a row failed: base * 2^(failures-1), capped, jittered.

    The jitter (a random half of the delay) keeps every worker replica from
    knocking on a restarting database in the same instant.
    """
    ceiling = min(cap, base * 2 ** max(failures - 1, 0))
    return ceiling / 2 + random.uniform(0, ceiling / 2)
