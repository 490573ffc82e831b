"""Model fingerprint: a digest of the weights being served, so stored KV never outlives them.

What is hashed, for the model's local folder (a path, or the Hugging Face cache snapshot that
vLLM resolved for a hub id, whose folder name is the commit):

* ``config.json`` / ``params.json``: in full (architecture, rope, quantization settings).
* every top-level weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``),
  by name and size, plus its content, cheaply:

  - the file's own checksum when it has one: a hub cache snapshot links each file to
    ``blobs/<sha256 of the content>``, so that name *is* the content hash (nothing is read);
  - else a full sha256 for files up to :data:`FULL_HASH_MAX` bytes;
  - else, for safetensors, the whole header (tensor names, dtypes, shapes, offsets, metadata)
    and :data:`SAMPLE` bytes at the start, middle and end of *every tensor*; for other
    formats, :data:`SAMPLES` chunks at fixed offsets. A fine-tune changes (almost) every
    element of each tensor it trains, so it changes the samples of every tensor it touches,
    while a 500 MB model costs a few MB of reads.

Results are cached per process by (path, size, inode, mtime, ctime): each process reads once.
A hub id whose files are not on this machine falls back to ``id@revision`` and says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import struct
from pathlib import Path

log = logging.getLogger(__name__)

FULL_HASH_MAX = 64 << 20
SAMPLE = 4096
SAMPLES = 64
CONFIG_FILES = ("config.json", "params.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")


def model_fingerprint(model: str, revision: str | None = None,
                      cache_dir: str | None = None) -> str:
    """16 hex digits naming the served weights (see the module docstring)."""
    folder = resolve_model_folder(model, revision, cache_dir)
    h = hashlib.sha256()
    if folder is None:
        log.warning("cwm connector: the files of model %r are not on this machine, so its "
                    "fingerprint is its name and revision (%s) only; pin a revision so that "
                    "stored KV cannot outlive a change of weights", model, revision or "none")
        h.update(f"id:{model}@{revision or ''}".encode())
        return h.hexdigest()[:16]
    for name in CONFIG_FILES:
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    weights = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)})
    for p in weights:
        h.update(f"{p.name}:{file_digest(p)}\n".encode())
    return h.hexdigest()[:16]


def resolve_model_folder(model: str, revision: str | None = None,
                         cache_dir: str | None = None) -> Path | None:
    """The local folder of ``model``: the path itself, or the hub cache snapshot of its id
    (in ``cache_dir``, vLLM's ``--download-dir``, else the default hub cache)."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision,
                                       cache_dir=cache_dir)
    except Exception:  # a malformed id: the name-only fallback says so
        return None
    return Path(found).parent if isinstance(found, str) else None


def file_digest(path: Path) -> str:
    """The content digest of one weight file, cached by (real path, size, mtime)."""
    real = path.resolve()
    if path.is_symlink() and _SHA256_NAME.fullmatch(real.name) and real.parent.name == "blobs":
        return f"sha256:{real.name}"            # the hub cache names blobs by their sha256
    st = real.stat()
    return _content_digest(str(real), st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns))


@functools.lru_cache(maxsize=4096)
def _content_digest(real: str, size: int, version: tuple[int, int, int]) -> str:
    """Digest of a file's content; ``version`` (inode, mtime, ctime) only keys the cache."""
    h = hashlib.sha256()
    with open(real, "rb") as f:
        if size <= FULL_HASH_MAX:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return f"sha256:{h.hexdigest()}"
        h.update(size.to_bytes(8, "big"))
        fd = f.fileno()
        regions = _safetensors_regions(fd, size) if real.endswith(".safetensors") else None
        if regions is None:
            step = (size - SAMPLE) // (SAMPLES - 1)
            regions = [(i * step, SAMPLE) for i in range(SAMPLES)]
        for offset, length in regions:
            h.update(os.pread(fd, length, offset))
    return f"sampled:{h.hexdigest()}"


def _safetensors_regions(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The header, then start/middle/end samples of every tensor; None if not safetensors."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return None
    (n,) = struct.unpack("<Q", raw)
    if n <= 0 or 8 + n > size:
        return None
    try:
        header = json.loads(os.pread(fd, n, 8))
    except ValueError:
        return None
    regions = [(0, 8 + n)]
    base = 8 + n
    for name in sorted(k for k in header if k != "__metadata__"):
        begin, end = header[name].get("data_offsets", (0, 0))
        length = end - begin
        if length <= 0:
            continue
        take = min(SAMPLE, length)
        for start in sorted({begin, begin + (length - take) // 2, end - take}):
            regions.append((base + start, take))
    return regions
