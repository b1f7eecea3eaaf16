"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mp():
    """A monkeypatch for module-scoped fixtures (the in-process runs that several tests read)."""
    with pytest.MonkeyPatch.context() as m:
        yield m
