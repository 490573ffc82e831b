"""Where a request's time goes: named stages timed with ``with stages("embed"): ...``.

The memory service and the sidecar add to one :class:`Stages` per request, so a breakdown
(auth, history, query embedding, keyword search, vector search, fusion, token counting, file
I/O) can be reported in a ``Server-Timing`` header, a metric and the benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Stages:
    """Seconds spent per stage (a stage entered twice adds up)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def merge(self, other: Stages) -> None:
        for name, s in other.seconds.items():
            self.add(name, s)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def server_timing(self) -> str:
        """The stages as a ``Server-Timing`` header value (milliseconds)."""
        parts = [f"{name};dur={s * 1000:.3f}" for name, s in self.seconds.items()]
        return ", ".join([*parts, f"total;dur={self.total * 1000:.3f}"])
