"""The client's own durable memory: one JSON file of operations and their keys.

Why it exists: an Idempotency-Key protects a payment only if the *same* key
comes back on every retry, including a retry made by a client process that
crashed and restarted. A key held only in memory dies with the process; the
restarted client would mint a new one and the server would see a new payment.
So the key is kept beside the pending request in the client's own store, and
a client that crashes and restarts recovers it.

Why it is written the way it is: the file is replaced atomically (write a
temporary file in the same directory, fsync it, `os.replace` it over the old
one, fsync the directory). A crash halfway through a write therefore leaves
the old file or the new one, never a torn mixture that would lose every key.

One process at a time per file: the lock here is per process (threads).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


class OperationStore:
    """Operations by id: `{"key", "payment", "state": "pending" | "done" | "refused", ...}`.

    `payment` is the request's body: a payment's, or a refund's (PaymentsClient.create_refund)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def all(self) -> dict[str, dict[str, Any]]:
        try:
            return json.loads(self.path.read_text())["operations"]
        except FileNotFoundError:
            return {}

    def get(self, operation_id: str) -> dict[str, Any] | None:
        return self.all().get(operation_id)

    def pending(self) -> dict[str, dict[str, Any]]:
        """What a restarted client must resume (with the keys it already used)."""
        return {op: rec for op, rec in self.all().items() if rec["state"] == "pending"}

    def put(self, operation_id: str, **fields: Any) -> dict[str, Any]:
        """Create or update one operation, durably, before returning."""
        with self._lock:
            operations = self.all()
            now = datetime.now(timezone.utc).isoformat()
            record = operations.get(operation_id) or {"created_at": now}
            record.update(fields, updated_at=now)
            operations[operation_id] = record
            self._write({"operations": operations})
            return record

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        # The rename itself lives in the directory: make it durable too.
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
