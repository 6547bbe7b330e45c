"""Database access: the engine, and the one helper that owns transactions."""
