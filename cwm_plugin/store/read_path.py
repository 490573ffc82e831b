"""Reading blocks back: each tier's blobs fetched in chunks, decoded on a pool as they arrive.

:class:`ReadPath`, a part of :class:`~cwm_plugin.store.kv_store.KVStore`. For each tier in
lookup order (memory -> disk -> Redis) the keys still missing are looked up in one batch; the
calling thread then fetches their blobs chunk by chunk (the memory tier at once; the disk file
by file into reused buffers (:mod:`.read_buffers`), after asking the kernel to read them
all ahead; Redis a pipelined round trip of a few blobs at a time) and hands every blob to
the decode pool as soon as its chunk arrives, so reading the next chunk overlaps decoding
the last one, and blocks decode in parallel (the codec's kernels release the GIL). A hit is
promoted to the faster tiers (:meth:`~cwm_plugin.store.write_path.WritePath.promote`),
except a disk file's blob delivered by :meth:`read_into` (below).

Two ways to receive blocks:

* :meth:`get_many` returns tensors (decoded into ``out[i]`` when given, else fresh);
* :meth:`read_into` decodes each block into a per-thread scratch tensor and hands it to a
  ``sink(i, tensor)`` on the decoding thread (the connector copies it straight into vLLM's
  paged cache: no batch staging tensor, each block still in the core's cache).

Both add seconds per stage to an optional :class:`~cwm_plugin.timing.Stages`:
``read`` (fetching, wall time of the calling thread), ``decompress``, ``transform`` and
``copy`` (the sink) summed over the decoding threads. Every blob is first checked to be the
key's (:mod:`.binding`: its key group, its key or the content the reader expects of a block,
with encryption at rest its exact key, its salt and that it is sealed at all, and that a
rewritten record is no older than one seen); one that is not is refused: a counted miss,
logged once. A damaged
blob is a counted miss, quarantined; a blob of another model or layout an incompatible miss; a
key whose bytes are gone is dropped from its tier (dangling); a failing tier is counted and
skipped.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cwm_plugin.errors import CorruptBlob, IncompatibleBlob, RefusedBlob
from cwm_plugin.store import binding
from cwm_plugin.store.blob import codec, crypto
from cwm_plugin.store.read_buffers import ReadBuffers
from cwm_plugin.store.threads import unpin
from cwm_plugin.store.tier_set import TierSet
from cwm_plugin.store.tiers.base import TIER_ERRORS, Tier
from cwm_plugin.store.write_path import WritePath
from cwm_plugin.timing import Stages

Sink = Callable[[int, torch.Tensor], bool]     # (key index, decoded block) -> accepted
KEEP_BUFFER_BYTES = 64 << 20    # read buffers kept for the next load (about 32 blobs of 8k-token
                                # SmolLM2 KV; an 8B model's 128-token blocks are 16 MB raw)
_scratch = threading.local()


@dataclass
class _Hit:
    index: int
    key: bytes
    blob_id: str
    data: bytes | memoryview     # a lent read buffer (a file tier's, on the decoding paths)
    tier: Tier
    content: bytes | None = None     # the content identity the reader expects (a KV block)


def _scratch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-thread block-sized tensor, reused (a cache, not state)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    t = bufs.get((shape, dtype))
    if t is None:
        t = bufs[shape, dtype] = torch.empty(shape, dtype=dtype)
    return t


class ReadPath:
    """Reads over ``tier_set``: blobs checked against ``binding``, hits promoted to the faster
    tiers through ``writes``, decoded on a pool of ``io_workers`` threads (none for one)."""

    def __init__(self, tier_set: TierSet, binding: binding.Binding, writes: WritePath) -> None:
        self.tier_set = tier_set
        self.config = tier_set.config
        self.metrics = tier_set.metrics
        self.binding = binding
        self.writes = writes
        workers = self.config.io_workers
        self._decoder = (cf.ThreadPoolExecutor(workers, thread_name_prefix="cwm-decode",
                                               initializer=unpin) if workers > 1 else None)
        self.buffers = ReadBuffers(KEEP_BUFFER_BYTES)

    def close(self) -> None:
        """Finish the decodes under way and stop the pool."""
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)

    def get(self, key: bytes, *, salt: str | None = None, primary: bool = False,
            content: bytes | None = None) -> torch.Tensor | None:
        return self.get_many([key], salt=salt, primary=primary,
                             contents=None if content is None else [content])[0]

    def get_many(self, keys: Sequence[bytes], *, out: torch.Tensor | None = None,
                 layout: str | None = None, salt: str | None = None, primary: bool = False,
                 stages: Stages | None = None, contents: Sequence[bytes] | None = None
                 ) -> list[torch.Tensor | None]:
        """Decoded tensors (None for a miss) for ``keys``, in order. ``out`` (optional,
        ``[len(keys), *block]``, contiguous CPU): hits whose dtype and shape match are decoded
        straight into ``out[i]``. ``layout``: the KV layout the blobs must carry (another is
        an incompatible, counted miss). ``salt``: the request's cache_salt (opens sealed
        blobs). ``primary``: what the primary tier says is the answer (a local copy of a
        record another server rewrote or deleted is stale); the other tiers are asked only
        while the primary is unreachable. ``contents``: each key's expected content identity
        (KV blocks: a blob another key shares is accepted for that content only)."""
        if out is not None and (out.dim() == 0 or out.shape[0] != len(keys)):
            raise ValueError(f"out has {tuple(out.shape)[:1]} rows for {len(keys)} keys")
        found: list[torch.Tensor | None] = [None] * len(keys)

        def keep(h: _Hit, cipher, st: Stages) -> bool:
            found[h.index] = self._decode(h, into=None if out is None else out[h.index],
                                          layout=layout, cipher=cipher, stages=st)
            return found[h.index] is not None

        self._read(keys, keep, salt, stages, primary=primary, contents=contents)
        return found

    def read_into(self, keys: Sequence[bytes], sink: Sink, *, shape: tuple[int, ...],
                  dtype: torch.dtype, into: Callable[[int], torch.Tensor] | None = None,
                  layout: str | None = None, salt: str | None = None,
                  stages: Stages | None = None, contents: Sequence[bytes] | None = None,
                  tiers: Sequence[Tier] | None = None) -> list[str | None]:
        """Decode each key's block and call ``sink(i, tensor)`` on the decoding thread
        (``contents``: as for :meth:`get_many`; ``tiers``: only these are read, in lookup
        order, as a caller that must not wait on I/O asks for the memory tier alone). The
        block is decoded into ``into(i)`` when given, else into a per-thread scratch tensor
        of ``shape`` and ``dtype`` that is reused once the sink returns (an uncompressed blob,
        the memory tier's: a read-only view of its bytes, no copy); a blob of another shape or
        dtype comes as its own tensor. A block read from a disk file is not copied up to
        the memory tier: the sink's receiver holds it now (vLLM's cache), and the copy cost an
        8k-token restore from disk 70-90 ms of its first token on 2 cores; blobs from Redis
        are promoted as by :meth:`get_many`. Returns, per key, the tier that served it, or
        None (a miss, or the sink said False or raised: logged once, never raised)."""
        def deliver(h: _Hit, cipher, st: Stages) -> bool:
            target = into(h.index) if into is not None else _scratch_tensor(tuple(shape), dtype)
            t = self._decode(h, into=target, layout=layout, cipher=cipher, stages=st,
                             borrow=into is None, promote=False)
            if t is None:
                return False
            t0 = time.perf_counter()
            try:
                return bool(sink(h.index, t))
            except Exception as exc:       # the receiver's problem: this block is a miss
                self.metrics.errors.labels("sink_failed").inc()
                self.tier_set.log_once("sink", "store: a loaded block could not be delivered: %s",
                                       exc)
                return False
            finally:
                st.add("copy", time.perf_counter() - t0)

        return self._read(keys, deliver, salt, stages, contents=contents, tiers=tiers)

    def _read(self, keys: Sequence[bytes], handle, salt: str | None,
              stages: Stages | None, *, primary: bool = False,
              contents: Sequence[bytes] | None = None,
              tiers: Sequence[Tier] | None = None) -> list[str | None]:
        keys = [bytes(k) for k in keys]
        if contents is not None and len(contents) != len(keys):
            raise ValueError(f"{len(contents)} contents for {len(keys)} keys")
        served: list[str | None] = [None] * len(keys)
        cipher = self.binding.cipher(salt)
        todo = list(range(len(keys)))
        order = tiers = self.tier_set.tiers if tiers is None else \
            [t for t in self.tier_set.tiers if t in tiers]
        first = self.tier_set.primary if primary else None
        if first is not None:
            order = [first, *(t for t in tiers if t is not first)]
        for n, tier in enumerate(order):
            if not todo or (primary and n > 0 and getattr(order[0], "available", True)):
                break
            jobs: list[tuple[_Hit, cf.Future | None, Stages]] = []

            def run(h: _Hit, st: Stages) -> bool:
                try:
                    return handle(h, cipher, st)
                except Exception as exc:      # a bug or no memory: a miss, never a crash
                    self.metrics.errors.labels("decode_failed").inc()
                    self.tier_set.log_once("decode-failed", "store: decoding block %s failed: "
                                           "%r", h.key.hex()[:16], exc)
                    return False
                finally:
                    self.buffers.give_back(h.data)

            fetching = Stages()
            for hits in self._fetch(tier, [keys[i] for i in todo], todo, fetching, lent=True):
                for h in hits:
                    h.content = None if contents is None else contents[h.index]
                    st = Stages()
                    if self._decoder is not None and len(todo) > 1:
                        jobs.append((h, self._decoder.submit(run, h, st), st))
                    else:
                        jobs.append((h, None, st))
                        served[h.index] = tier.name if run(h, st) else None
            if stages is not None:
                stages.merge(fetching)
            for h, fut, st in jobs:
                if fut is not None and fut.result():
                    served[h.index] = tier.name
                if stages is not None:
                    stages.merge(st)
            todo = [i for i in todo if served[i] is None]
        self.metrics.misses.labels("all").inc(len(todo))
        return served

    def _fetch(self, tier: Tier, keys: list[bytes], idx: list[int],
               stages: Stages | None = None, *, lent: bool = False):
        """Yield the hits of ``keys`` in ``tier`` chunk by chunk (see the module docstring);
        the seconds spent looking up and fetching go to ``stages["read"]``. ``lent``: the
        blobs in buffers lent by :attr:`buffers` where the tier reads files
        (:meth:`Tier.read_lent`), for a decoding reader that gives them back; else ``bytes``."""
        stages = stages if stages is not None else Stages()
        t0 = time.perf_counter()
        ids = self.tier_set.lookup_in(tier, keys)
        want = list(dict.fromkeys(b for b in ids if b is not None))
        if not want:
            self.metrics.misses.labels(tier.name).inc(len(keys))
            stages.add("read", time.perf_counter() - t0)
            return
        by_blob: dict[str, list[tuple[int, bytes]]] = {}
        for i, key, b in zip(idx, keys, ids, strict=True):
            if b is not None:
                by_blob.setdefault(b, []).append((i, key))
        with contextlib.suppress(*TIER_ERRORS):
            tier.prefetch(want)
        stages.add("read", time.perf_counter() - t0)
        size = self._chunk_size(tier, len(want))
        n_hits = 0
        for start in range(0, len(want), size):
            part = want[start:start + size]
            t0 = time.perf_counter()
            try:
                datas = tier.read_lent(part, self.buffers) if lent else tier.get_many(part)
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, "read", exc, "read_failed")
                break
            finally:
                stages.add("read", time.perf_counter() - t0)
            hits: list[_Hit] = []
            dangling: list[tuple[bytes, str]] = []
            for b, data in zip(part, datas, strict=True):
                for i, key in by_blob[b]:
                    if data is None:
                        dangling.append((key, b))
                    else:
                        hits.append(_Hit(i, key, b, data, tier))
            if dangling:      # the index outlived the bytes (expiry, eviction, a lost file)
                with contextlib.suppress(*TIER_ERRORS):
                    tier.forget_blobs([b for _, b in dangling], "dangling",
                                      keys=[k for k, _ in dangling])
            n_hits += len(hits)
            yield hits
        self.metrics.misses.labels(tier.name).inc(len(keys) - n_hits)

    def _chunk_size(self, tier: Tier, n: int) -> int:
        """Blobs per fetch: the tier's own limit, and small enough that a pipeline forms
        (at least two chunks for every decoding thread)."""
        workers = self.config.io_workers
        return max(1, min(tier.read_batch, math.ceil(n / (2 * workers))))

    def _decode(self, h: _Hit, *, into: torch.Tensor | None, layout: str | None,
                cipher: crypto.BlobCipher | None, stages: Stages | None = None,
                borrow: bool = False, promote: bool = True) -> torch.Tensor | None:
        """``h`` decoded (None: a counted miss) and promoted to the faster tiers; a blob read
        into a lent buffer (a disk file) only if ``promote`` (copied: the buffer goes back)."""
        t0 = time.perf_counter()
        plain = self._open(h, cipher)
        if plain is None:
            return None
        try:
            decoded = codec.decode(plain, fingerprint=self.config.fingerprint or None,
                                   layout=layout, verify=self.config.checksum, into=into,
                                   stages=stages, borrow=borrow)
        except (CorruptBlob, IncompatibleBlob) as exc:
            self._bad_blob(h, exc)
            return None
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        self.metrics.hits.labels(h.tier.name).inc()
        if promote or isinstance(h.data, bytes):
            self.writes.promote(h.key, h.blob_id, h.data, found_in=h.tier)
        return decoded.tensor

    def _open(self, h: _Hit, cipher: crypto.BlobCipher | None) -> bytes | None:
        """The hit's plain blob once it is found to be its key's (:mod:`.binding`); None: a
        counted miss."""
        try:
            return binding.opened(h.data, h.key, cipher, content=h.content,
                                  revisions=self.binding.revisions)
        except (CorruptBlob, IncompatibleBlob) as exc:
            self._bad_blob(h, exc)
            return None

    def get_blob(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key`` (not checked, not decoded, still sealed if encrypted)."""
        for tier in self.tier_set.tiers:
            for hits in self._fetch(tier, [bytes(key)], [0]):
                if hits:
                    self.metrics.hits.labels(tier.name).inc()
                    return hits[0].data
        return None

    def get_plain(self, key: bytes, *, salt: str | None = None,
                  content: bytes | None = None) -> bytes | None:
        """``key``'s blob checked as a read (expecting ``content``) checks it and opened for
        ``salt``, not decoded (what a window's re-key and export copy). None: no tier serves
        one that is ``key``'s."""
        cipher = self.binding.cipher(salt)
        for tier in self.tier_set.tiers:
            for hits in self._fetch(tier, [bytes(key)], [0]):
                for h in hits:
                    h.content = content
                plain = self._open(hits[0], cipher) if hits else None
                if plain is not None:
                    self.metrics.hits.labels(tier.name).inc()
                    return plain
        return None


    def _bad_blob(self, h: _Hit, exc: CorruptBlob | IncompatibleBlob) -> None:
        """Count, log (once) and, when damaged, quarantine a blob that is a miss."""
        self.metrics.misses.labels(h.tier.name).inc()
        if isinstance(exc, RefusedBlob):     # not the key's: left alone (it may be another's)
            self.metrics.errors.labels(f"refused_{exc.reason}").inc()
            self.tier_set.log_once(f"refused-{exc.reason}-{h.tier.name}", "store: refused blob "
                                   "%s for key %s in %s tier (%s): %s; treated as a miss",
                                   h.blob_id, h.key.hex()[:16], h.tier.name, exc.reason, exc)
            return
        kind = "corrupt" if isinstance(exc, CorruptBlob) else "incompatible"
        self.metrics.errors.labels(kind).inc()
        self.tier_set.log_once(f"bad-{h.blob_id}", "store: %s blob %s for key %s in %s tier: "
                               "%s; treated as a miss%s", kind, h.blob_id, h.key.hex()[:16],
                               h.tier.name, exc, ", quarantined" if kind == "corrupt" else "")
        if kind == "corrupt":
            self.tier_set.quarantine(h.tier, h.blob_id, h.data, key=h.key, reason=str(exc))
