"""The double-entry ledger: every movement of money, balanced per payment."""
