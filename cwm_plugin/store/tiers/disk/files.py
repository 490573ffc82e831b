"""File helpers of the disk tier: the key in a blob file's header, page-cache advice, a lock
across processes, and fsync of a directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from cwm_plugin.errors import CorruptBlob
from cwm_plugin.store.blob import container


def key_of_file(path: Path) -> bytes:
    """The key a blob file was saved under, from its header (the payload is not read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptBlob(f"{len(head)}-byte file")
        (n,) = struct.unpack("<Q", head)
        if n > container.MAX_HEADER:
            raise CorruptBlob(f"header length {n}")
        head += f.read(n)
    meta = container.read_header(head)[0]
    try:
        return bytes.fromhex(meta["key"])
    except (KeyError, ValueError) as exc:
        raise CorruptBlob("no key in the header") from exc


def advise_files(paths: Sequence[Path], advice: str) -> int:
    """``posix_fadvise(POSIX_FADV_<advice>)`` on each file (``WILLNEED``: start reading it;
    ``DONTNEED``: drop its clean pages from the page cache, so the next read comes from the
    device). Returns how many files took the advice (none where the platform has no fadvise;
    a missing file is skipped)."""
    flag = getattr(os, f"POSIX_FADV_{advice}", None)
    if flag is None:
        return 0
    n = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, flag)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (recovery of the index happens once)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
