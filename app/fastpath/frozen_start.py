"""What a served process builds at start, set aside from Python's cyclic garbage collector: an optimisation.

Not on a request's path. app/cli.py::serve hands uvicorn `build`, below, as
the factory of every process it serves (`payments api` and the naive twin
alike, so the bench compares the two flows, not two tunings), and names the
app's own factory in the environment, which uvicorn's worker processes
inherit.

Python's cyclic collector walks every container object that is still alive
whenever it collects the oldest generation. In a served process that is
mostly what start-up made: the imported modules, the app, its routes and
models, which live as long as the process and never become garbage.
`gc.freeze()` moves everything alive at that moment into a generation the
collector never walks; what requests make afterwards is collected as
before. The cost: an object alive at the freeze and dropped later is freed
only if no reference cycle holds it; what start-up makes is held for the
process's life, so little of it is ever dropped. What it saves, measured:
docs/reference/performance.md#pythons-cyclic-collector-set-aside-at-start.
"""

from __future__ import annotations

import gc
import importlib
import os
from typing import Any

# The app's own factory ("module:function"), set by app/cli.py::serve before uvicorn starts.
FACTORY = "PAYMENTS_SERVED_FACTORY"


def build() -> Any:
    """The app the served factory builds, with everything alive after it frozen out of the collector's walks."""
    module, _, name = os.environ[FACTORY].partition(":")
    app = getattr(importlib.import_module(module), name)()
    gc.collect()  # what start-up left behind as garbage is freed, not frozen
    gc.freeze()
    return app
