"""Fixtures for the language tests: the standard library is tests/dsl/fixtures, not stdlib/.

Other engineers fill stdlib/; the tests must not change when they do.
"""
from pathlib import Path

import pytest

import piper.dsl.program as program

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: property-based fuzzing of the checker (runs in CI, about 20 s)")


@pytest.fixture(autouse=True)
def stdlib_is_fixtures(monkeypatch):
    """`use NAME` finds tests/dsl/fixtures/NAME.pps (relative, so golden output is stable)."""
    monkeypatch.setattr(program, "stdlib_root", lambda: Path("fixtures") if Path.cwd() == HERE else FIXTURES)


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")
