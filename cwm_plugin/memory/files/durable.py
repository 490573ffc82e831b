"""Durable file writes and consistent reads, across threads and processes.

Appends are whole or not at all for a reader: written under an exclusive ``flock`` on
``<path>.lock``, flushed and fsynced (a failed write is cut back to where it began), and read
under the shared lock; a rewrite goes to a temporary file renamed over the old one, the folder
fsynced. The memory's markdown files (``markdown.py``) and its saved indexes
(``index/persist.py``) use them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` (threads and processes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def append_durable(path: Path, data: bytes, *, sync: bool = True) -> tuple[int, int]:
    """Append under the lock, flush and fsync (and the folder of a new file); (start, end).
    ``sync=False`` only flushes (a derived file whose tail may be lost in a crash)."""
    new = not path.exists()
    with file_lock(path), open(path, "ab") as fh:
        start = fh.seek(0, os.SEEK_END)
        try:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        except BaseException:  # a full disk: no torn record left for the next append to follow
            with contextlib.suppress(OSError):
                fh.truncate(start)
            raise
        end = fh.tell()
    if new and sync:
        _fsync_dir(path.parent)
    return start, end


def read_locked(path: Path, offset: int = 0) -> bytes:
    """The file's bytes from ``offset`` on, read while no append (:func:`file_lock`) is under
    way, so never half a record: a shared lock on ``<path>.lock``, or none where it cannot be
    opened (a read-only copy of the root)."""
    def read() -> bytes:
        with open(path, "rb") as data:
            data.seek(offset)
            return data.read()

    try:
        fh = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - closed below
    except OSError:
        return read()
    with fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH)
        try:
            return read()
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def replace_durable(path: Path, text: str) -> None:
    """Write a temporary file, fsync it, rename it over ``path``, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
