"""The store's worker threads may use every core the process uses, not the one they were born on.

vLLM's CPU worker binds each of its OpenMP threads to one core, the worker's main thread
included (``VLLM_CPU_OMP_THREADS_BIND``), and a thread inherits the affinity of the thread
that starts it: the store's decode and save pools, started from that main thread, all ran on
its one core (seen in ``/proc/<worker>/task/*/status``: every thread but OpenMP's second on
core 0), so blocks decoded one at a time while the other core idled. Each pool thread widens
its own affinity at start to the union of the CPUs any thread of the process may use (what
vLLM chose, inside any ``taskset`` or cpuset the process was started with).
"""

from __future__ import annotations

import contextlib
import os


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on (Linux; else every CPU)."""
    cpus: set[int] = set()
    if hasattr(os, "sched_getaffinity"):
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            tasks = []
        for tid in tasks:
            with contextlib.suppress(OSError, ValueError):
                cpus |= os.sched_getaffinity(int(tid))
    return cpus or set(range(os.cpu_count() or 1))


def unpin() -> None:
    """Let the calling thread run on every CPU of :func:`process_cpus` (a pool initializer)."""
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, process_cpus())
