"""Shared fixtures for the configuration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

FAKE_HOME = "/home/tester"


@pytest.fixture
def fake_home(fs) -> Path:
    """A home folder on the fake filesystem (pyfakefs)."""
    fs.create_dir(FAKE_HOME)
    return Path(FAKE_HOME)  # made while pyfakefs is active, so it compares with fake paths


@pytest.fixture
def env(fake_home: Path) -> dict[str, str]:
    """An environment holding only HOME, so the developer's own variables never leak in."""
    return {"HOME": str(fake_home)}
