"""The payment operation: its recovery points, its phases, and the runner."""
