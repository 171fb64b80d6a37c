"""What the tests that drive the official Tinker SDK against the local server share."""

from __future__ import annotations

import pytest

SDK_WARNINGS = [
    # The SDK's own deprecations and the sockets it leaves to the collector are not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:tinker"),
    pytest.mark.filterwarnings("ignore::FutureWarning:tinker"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
"""The warning filters of a module of SDK tests: ``pytestmark = [..., *SDK_WARNINGS]``."""
