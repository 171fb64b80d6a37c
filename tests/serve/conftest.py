"""Fixtures the serving tests share: a module's ``served`` server is its own; its client is this."""

from __future__ import annotations

import pytest
from serving import openai_client


@pytest.fixture
def client(served):
    """The official OpenAI client on the module's ``served`` HTTP server (its key, no retries, bounded waits)."""
    with openai_client(served) as c:
        yield c
