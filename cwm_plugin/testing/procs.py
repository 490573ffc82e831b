"""Small helpers shared by the server fixtures: free ports, readiness polling, process groups,
and another process holding a SQLite write lock (the disk index busy elsewhere)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout: float,
    interval: float = 0.5,
    alive: Callable[[], bool] = lambda: True,
    what: str = "condition",
    log_tail: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``ready`` until true; raise with the log tail if time runs out or the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not alive():
            raise RuntimeError(f"{what}: the process exited before it was ready\n{log_tail()}")
        time.sleep(interval)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f}s\n{log_tail()}")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc."""
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()   # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def stop_process_group(proc: subprocess.Popen, *, grace: float = 20.0) -> None:
    """SIGTERM the leader of ``proc``'s process group (its own session), wait up to ``grace``
    seconds for the *whole group* to exit, then SIGKILL what is left.

    Only the leader gets SIGTERM, so that it shuts its children down in order (vLLM's API
    server stops the engine, which shuts the workers and their KV connector down cleanly).
    The leader may exit before its children have finished (a worker still flushing its
    saves): the group is waited for, not just the leader, so nothing is killed mid-flush.
    """
    terminate_leader(proc)
    wait_process_group(proc, grace=grace)


def terminate_leader(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc`` (the leader of its process group) if it still runs, and return."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)


def wait_process_group(proc: subprocess.Popen, *, grace: float = 20.0) -> None:
    """Wait up to ``grace`` seconds for ``proc``'s whole process group to exit (after
    :func:`terminate_leader`), then SIGKILL what is left."""
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether ``GET url`` answers 200 (a server's readiness probe)."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def tail(path: str | os.PathLike[str], n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


_LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


def hold_sqlite_write_lock(path: str | os.PathLike[str], seconds: float) -> subprocess.Popen:
    """Another process takes the database's write lock and holds it ``seconds``; returns once
    the lock is held (``wait()`` on the process answers 0 once it let go)."""
    proc = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout is None or proc.stdout.readline().strip() != "locked":
        proc.kill()
        raise RuntimeError(f"could not take the write lock of {path}")
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (its own session) at once: a crash, nothing finished."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    # the group's other processes die on their own time: a server restarted at once on the
    # same data (PostgreSQL's shared memory, a port) must not find one of them still there
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie has let go of everything)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait for it, SIGKILL past ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
