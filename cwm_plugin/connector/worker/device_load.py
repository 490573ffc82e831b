"""Restoring blocks into a paged KV cache that lives on a GPU (or any non-CPU device).

The store decodes on the host (the codec's kernels are CPU code, run in parallel on the
store's threads), so a device restore is: decode the step's blocks into one reused, *pinned*
host staging tensor ``[n, L, *block]`` (at most ``staging_bytes``: a longer restore goes in
rounds); copy it to the device on a side stream
(``non_blocking``, in chunks through a bounded device scratch so the copy never needs more
device memory than ``scratch_bytes``); scatter each chunk into every layer's blocks with a
device ``index_copy_``; record one CUDA event per layer after its last scatter.

:meth:`DeviceLoader.submit` returns as soon as the copies are queued: the host goes on to
queue the forward pass, and the connector's ``wait_for_layer_load(layer)`` makes the compute
stream wait for that layer's event (:meth:`wait_layer`, a device-side wait: the host never
blocks). The side stream first waits for the work already queued on the compute stream, so a
block that vLLM just reallocated is never written while an earlier step may still use it; the
pinned staging is reused only after the last copy out of it has finished.

On a CPU device (tests, or a device without streams) the same calls copy synchronously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cwm_kernels.blocks import scatter_blocks

DEFAULT_SCRATCH_BYTES = 64 << 20      # device memory for copies in flight, beyond vLLM's budget
DEFAULT_STAGING_BYTES = 512 << 20     # pinned host memory a worker keeps for restores


class DeviceLoader:
    """Staging and copies for one worker's paged layers (all on one device, block axis 0)."""

    def __init__(self, layers: Sequence[torch.Tensor], per_block: tuple[int, ...],
                 dtype: torch.dtype, *, scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if not layers:
            raise ValueError("DeviceLoader needs at least one layer")
        self.layers = list(layers)
        self.per_block = tuple(per_block)
        self.dtype = dtype
        self.device = self.layers[0].device
        self.cuda = self.device.type == "cuda"
        block_bytes = math.prod(self.per_block) * torch.empty(0, dtype=dtype).element_size()
        self.chunk = max(1, scratch_bytes // block_bytes)    # blocks per device copy
        self.max_rows = max(1, staging_bytes // block_bytes)  # blocks staged at once
        self._host: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None      # pinned block ids of the last submit
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._events: list | None = None      # one per layer, of the last submit
        self._done = None                      # the last copy out of the host staging

    def staging(self, n: int) -> torch.Tensor:
        """A host tensor ``[n, L, *block]`` (``n <= max_rows``) to decode into, pinned on a
        GPU and reused across steps: waits for the previous copies out of it first."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        if n > self.max_rows:
            raise ValueError(f"{n} blocks exceed the staging's {self.max_rows}")
        if self._host is None or self._host.shape[0] < n:
            grow = min(self.max_rows, max(n, 2 * self._host.shape[0] if self._host is not None
                                          else n))
            self._host = None               # the old pinned buffer goes before the new one
            self._host = torch.empty((grow, *self.per_block), dtype=self.dtype,
                                     pin_memory=self.cuda)
        return self._host[:n]

    def submit(self, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy staged rows ``rows`` into paged blocks ``block_ids`` of every layer: queued on
        the side stream on a GPU (returns at once), done before returning on a CPU."""
        if len(rows) != len(block_ids):
            raise ValueError(f"{len(rows)} staged rows for {len(block_ids)} blocks")
        if not rows:
            return
        if self._host is None:
            raise RuntimeError("submit() before staging()")
        pieces = self._pieces(list(rows))
        if not self.cuda:
            for lo, hi, at in pieces:
                scatter_blocks(self.layers, 0, block_ids[at:at + hi - lo], self._host[lo:hi])
            return
        # Block ids go to the device from pinned memory too: a copy from pageable memory
        # would make the host wait for the side stream, i.e. for the queued compute.
        if self._done is not None:          # the pinned ids of the last submit are in flight
            self._done.synchronize()
        ids = self._pinned_ids(block_ids)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        events: list = []
        with torch.cuda.stream(stream):
            for n, (lo, hi, at) in enumerate(pieces):
                dev = self._scratch_for(hi - lo)
                dev.copy_(self._host[lo:hi], non_blocking=True)
                idx = ids[at:at + hi - lo].to(self.device, non_blocking=True)
                for i, layer in enumerate(self.layers):
                    layer.index_copy_(0, idx, dev[:, i])
                    if n == len(pieces) - 1:      # layer i is complete after this scatter
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        events.append(ev)
        self._events = events
        self._done = events[-1]

    def _pieces(self, rows: list[int]) -> list[tuple[int, int, int]]:
        """``rows`` as copies of contiguous staged rows ``[lo, hi)`` of at most ``chunk``
        blocks; ``at`` is the first one's position in ``rows`` (and in the block ids)."""
        out: list[tuple[int, int, int]] = []
        at = 0
        while at < len(rows):
            end = at + 1
            while end < len(rows) and end - at < self.chunk and rows[end] == rows[end - 1] + 1:
                end += 1
            out.append((rows[at], rows[at] + end - at, at))
            at = end
        return out

    def _pinned_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        if self._ids is None or self._ids.numel() < len(block_ids):
            self._ids = torch.empty(max(len(block_ids), 256), dtype=torch.long, pin_memory=True)
        out = self._ids[:len(block_ids)]
        out.copy_(torch.as_tensor(list(block_ids), dtype=torch.long))
        return out

    def _scratch_for(self, n: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty((self.chunk, *self.per_block), dtype=self.dtype,
                                        device=self.device)
        return self._scratch[:n]

    def clear(self) -> None:
        """Forget the last step's events (a step that restores nothing waits for nothing)."""
        self._events = None

    def wait_layer(self, index: int) -> None:
        """Make the current (compute) stream wait until layer ``index`` is restored: queued on
        the device, the host does not block. A no-op when nothing was submitted."""
        if self._events is not None and 0 <= index < len(self._events):
            torch.cuda.current_stream(self.device).wait_event(self._events[index])

    def wait_all(self) -> None:
        """Block the host until every queued copy has finished (tests, shutdown)."""
        if self._done is not None:
            self._done.synchronize()
