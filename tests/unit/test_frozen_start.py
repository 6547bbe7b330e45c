"""app/fastpath/frozen_start.py: the factory `serve` hands uvicorn builds the app it names, then freezes the heap.

In a process of its own: a freeze is for the rest of a process's life, and
this test's process is pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys

from app.fastpath import frozen_start

PROBE = """
import gc
from app.fastpath import frozen_start
assert gc.get_freeze_count() == 0, gc.get_freeze_count()
app = frozen_start.build()
print(type(app).__name__, gc.get_freeze_count() > 0)
"""


def test_the_served_factory_builds_the_named_app_and_freezes_what_start_up_made():
    # The app is built, not started: nothing connects to this URL.
    env = {**os.environ, frozen_start.FACTORY: "naive_twin.app:create_app",
           "DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["FastAPI", "True"]
