"""Payment batches: a file of rows, each paid once through the payment's machine (docs/batches.md)."""
