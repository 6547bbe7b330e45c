import pytest


@pytest.fixture(autouse=True)
async def _fresh_state(clean) -> None:
    """Every test here starts from empty tables and empty fault plans."""
