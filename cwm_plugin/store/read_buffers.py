"""Reusable buffers for blobs read from files on their way to the decoders.

Reading a blob file into a fresh ``bytes`` costs the copy out of the page cache *and* a page
fault for every 4 KiB of the new buffer: 8k tokens of SmolLM2-135M KV (62 blobs, 183 MB raw)
took 95-121 ms with 44k faults on a 2-core VM, where a copy into memory already touched takes
about 30 ms. :class:`ReadBuffers` lends a buffer for each blob (one that fits from the free
list, else a new one), and takes it back once its blob is decoded; it keeps at most
``keep_bytes`` of free buffers, so a burst of loads leaves no more than that behind. It never
waits: a borrower that finds nothing free gets a new buffer, so a reader that runs ahead of
its decoders cannot deadlock on it. (Mapping the files instead was faster still, 3 ms, but a
mapped page that fails to read, or a file truncated from outside, kills the process with
SIGBUS: a cache tier must not take vLLM down.)
"""

from __future__ import annotations

import threading

GRAIN = 1 << 16           # buffer sizes rounded up to 64 KiB, so blobs of one kind share them


class ReadBuffers:
    """A free list of ``bytearray`` buffers, at most ``keep_bytes`` of them kept."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[bytearray] = []
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes of a buffer lent until :meth:`give_back`
        (its content is whatever it held before)."""
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                if len(buf) >= size and (best is None or len(buf) < len(self._free[best])):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self._free_bytes -= len(buf)
                return memoryview(buf)[:size]
        return memoryview(bytearray(-(-max(size, 1) // GRAIN) * GRAIN))[:size]

    def give_back(self, view: object) -> None:
        """Return a view :meth:`take` lent (anything else is ignored); its buffer is kept for
        the next borrower unless the free list is full. The caller holds no other view of it."""
        if not isinstance(view, memoryview) or not isinstance(view.obj, bytearray):
            return
        buf = view.obj
        with self._lock:
            if self._free_bytes + len(buf) <= self.keep_bytes:
                self._free.append(buf)
                self._free_bytes += len(buf)

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
