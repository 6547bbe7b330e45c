"""Client refunds: the second operation a client starts, on the same machine as its payment (refund.py first)."""
