"""Small helpers shared by the server fixtures: free ports, readiness polling, process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable


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


def stop_process_group(proc: subprocess.Popen, *, grace: float = 20.0) -> None:
    """SIGTERM the leader of ``proc``'s process group (its own session), then SIGKILL the group.

    Only the leader gets SIGTERM, so that it shuts its children down in order (vLLM's API
    server stops the engine, which shuts the workers and their KV connector down cleanly).
    """
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    # Children (vLLM's engine core, workers) live in the same group; make sure none linger.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def tail(path: str | os.PathLike[str], n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
