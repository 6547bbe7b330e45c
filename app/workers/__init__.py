"""Background work beside the API: the recovery worker (later: reconciliation)."""
