"""The message broker the batch rows travel through: NATS JetStream (docs/batches.md)."""
