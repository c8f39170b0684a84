"""Fixtures for the trim tests: the real edge tokenizer, loaded once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from policies.trim.tokenizer import edge_token_counter


@pytest.fixture(scope="session")
def edge_count() -> Callable[[str], int]:
    """The SmolLM2 tokenizer's count, vocabulary only."""
    return edge_token_counter()
