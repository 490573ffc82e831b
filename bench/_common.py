"""Small helpers shared by the benchmarks: timing, a text table, JSON output."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def best_time(fn: Callable[[], Any], repeat: int = 3,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds (after one warm-up run).
    ``clock=time.thread_time`` measures the CPU time of this thread (one-core benchmarks on
    a shared machine: other processes' load does not count, cache contention still does)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def percentile(xs: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile of ``xs`` (NaN when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] if xs else math.nan


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows of dicts as an aligned text table (floats with 3 decimals)."""
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name (figures vary with it: kernels, AVX2 vs AVX-512)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Where a figure was measured: the CPU, its ISA and the dtype it computes in."""
    import os

    from cwm_plugin.compute_dtype import compute_dtype, isa

    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "processor": platform.processor(), "cpu": cpu_model(),
            "isa": isa(), "compute_dtype": compute_dtype()}


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages (another process's work slows every figure)."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def evict_page_cache(path: str | Path) -> int:
    """Write back, then drop every file under ``path`` from the page cache
    (``posix_fadvise(DONTNEED)``), so that the next read comes from the device: a cold
    start. Returns the number of files evicted."""
    import os

    from cwm_plugin.store.tiers.disk.tier import advise_files

    os.sync()
    return advise_files([f for f in Path(path).rglob("*") if f.is_file()], "DONTNEED")


def bandwidth(mb: int = 256, repeat: int = 3) -> dict[str, float]:
    """This machine's one-thread memory copy (``memcpy_gbps``: ``mb`` MB between two buffers
    already touched) and cached file read (``cached_read_gbps``: a file of ``mb`` MB in the
    page cache read into a reused buffer), best of ``repeat``, in GB/s."""
    import os
    import tempfile

    import numpy as np

    n = mb << 20
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    copy = best_time(lambda: np.copyto(b, a), repeat)
    with tempfile.NamedTemporaryFile(dir=Path.home(), prefix=".cwm-bench-bw-") as f:
        f.write(a.data)
        f.flush()
        view = memoryview(b)

        def read() -> None:
            with open(f.name, "rb", buffering=0) as r:
                got = 0
                while got < n:
                    got += r.readinto(view[got:]) or n
        cached = best_time(read, repeat)
        os.sync()
    return {"memcpy_gbps": n / copy / 1e9, "cached_read_gbps": n / cached / 1e9}


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {p}")
