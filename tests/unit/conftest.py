"""Fixtures of the bench scripts' unit tests: a bench module imported as the scripts import
each other (``bench/`` on ``sys.path`` for the test only)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_module(monkeypatch) -> Callable[[str], ModuleType]:
    """``bench_module("ttft")``: bench/ttft.py imported, with bench/ on the path."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module
