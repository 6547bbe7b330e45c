"""Dependencies point one way in the whole checkout, and no module cycle hides anywhere: checked on every `make test`.

The contracts live in pyproject.toml ([tool.importlinter]): across the
checkout, (bench, demos) -> redis_twin -> (devtools, naive_twin) -> app, with the fakes and
the client SDK importing neither the service nor each other; inside the
service, api -> payments -> (idempotency, ledger, rails, outbox, db), workers
beside api; nothing importing back up a layer, and no two sibling modules
importing each other in any package. A learner can then read the service
from the top down, and a lower layer can be tested without the ones above
it. This runs import-linter's own command, exactly as a developer would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
