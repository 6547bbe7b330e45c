"""The payment and the refund of a returned payout: their machines (payment.py, returns.py), phases and rows."""
