"""The idempotency key protocol: validate, fingerprint, claim, take over, replay."""
