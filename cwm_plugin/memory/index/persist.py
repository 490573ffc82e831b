"""The derived chunk index of a folder on disk, so a restart does not rebuild it.

Layout: ``<root>/.index/<folder>/CURRENT`` names a generation folder next to it that holds

- ``manifest.json``: format, the settings the index depends on (embedder, tokenizer, chunk
  size, overlap, context lines), and for each session file the byte ``offset`` indexed so
  far, the file's ``size`` and ``mtime_ns`` when last seen, and the sha256 of its first
  ``offset`` bytes (``FileMark``);
- ``sessions.json``: the chunk table: each session's lines (text, turn id, time, tokens),
  their vector labels and its chunk spans (begin, end, chunk id, tokens);
- ``vectors.npy`` (line vectors) and ``lines.hnsw`` (hnswlib over them).

A generation is written completely (files fsynced) before ``CURRENT`` is replaced atomically
(temporary file + rename), and older generations are removed afterwards, under a lock that
writers of one folder share: a reader sees the old index or the new one, never a mix, and a
crash leaves at worst an unused folder (removed by a later save once an hour old). ``load``
returns ``None`` when there is nothing usable (no index, other settings, unreadable files): the
caller rebuilds from the markdown files, which stay the truth. Whether each session file still
matches its mark is checked by the caller (``folders.py``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hnswlib
import numpy as np

from cwm_plugin.memory.files.durable import file_lock, replace_durable
from cwm_plugin.memory.index.chunking import Unit, make_chunk
from cwm_plugin.memory.index.chunks import ChunkIndex, SessionIndex

log = logging.getLogger(__name__)
FORMAT = 1
INDEX_DIR = ".index"
STALE_TMP_S = 3600  # an unfinished generation this old belongs to a writer that died


@dataclass
class FileMark:
    """How much of a session file an index covers, and what the file looked like then."""

    offset: int
    size: int
    mtime_ns: int
    digest: str  # sha256 hex of the first ``offset`` bytes


def fingerprint(idx: ChunkIndex) -> dict[str, object]:
    """Everything the stored chunks and vectors depend on."""
    return {"format": FORMAT, "embedder": idx.embedder.name, "dims": idx.embedder.dims,
            "tokenizer": idx.counter.name, "chunk_tokens": idx.chunk_tokens,
            "overlap": idx.overlap, "context_lines": idx.context_lines,
            "context_mode": idx.context_mode}


def folder_dir(root: Path, folder: str) -> Path:
    return Path(root) / INDEX_DIR / folder


def current_generation(root: Path, folder: str) -> str | None:
    try:
        return (folder_dir(root, folder) / "CURRENT").read_text().strip() or None
    except OSError:
        return None


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def save(idx: ChunkIndex, marks: dict[str, FileMark], root: Path, folder: str) -> str:
    """Write a new generation of the folder's index and make it current; returns its name."""
    base = folder_dir(root, folder)
    gen = f"g{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(2)}"
    tmp = base / f".{gen}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _write_generation(idx, marks, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (a full disk is not filled further)
        raise
    # Two savers of one folder (the sidecar and `cwm memory reindex`) take turns here, so
    # CURRENT always names a folder that exists; each removes the generations before its own
    # and unfinished ones a crashed writer left (hidden, older than STALE_TMP_S).
    with file_lock(base / "CURRENT"):
        os.replace(tmp, base / gen)
        replace_durable(base / "CURRENT", gen + "\n")
        now = time.time()
        for old in base.iterdir():
            if not old.is_dir() or old.name == gen:
                continue
            hidden = old.name.startswith(".")
            if not hidden or (old.name.endswith(".tmp")
                              and now - old.stat().st_mtime > STALE_TMP_S):
                shutil.rmtree(old, ignore_errors=True)
    return gen


def _write_generation(idx: ChunkIndex, marks: dict[str, FileMark], tmp: Path) -> None:
    """The index's files in ``tmp``, synced."""
    sessions = {name: {"units": [[u.text, u.turn_id, u.ts, u.tokens] for u in st.units],
                       "labels": st.labels,
                       "spans": [[b, e, cid, idx.chunks[cid].tokens] for b, e, cid in st.spans]}
                for name, st in idx.sessions.items()}
    manifest = {**fingerprint(idx), "marks": {s: asdict(m) for s, m in marks.items()},
                "deleted": idx.deleted, "n_vectors": idx.n_vectors}
    _write(tmp / "sessions.json", json.dumps(sessions, ensure_ascii=False).encode())
    _write(tmp / "manifest.json", json.dumps(manifest).encode())
    np.save(tmp / "vectors.npy", idx.vectors)
    idx.hnsw.save_index(str(tmp / "lines.hnsw"))
    for name in ("vectors.npy", "lines.hnsw"):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())


def load(idx: ChunkIndex, root: Path, folder: str) -> tuple[dict[str, FileMark], str] | None:
    """Fill the empty ``idx`` from the current generation; ``(marks, generation)`` or None."""
    gen = current_generation(root, folder)
    if gen is None:
        return None
    gen_dir = folder_dir(root, folder) / gen
    try:
        manifest = json.loads((gen_dir / "manifest.json").read_text())
        if {k: manifest.get(k) for k in fingerprint(idx)} != fingerprint(idx):
            log.info("index of folder %s was built with other settings: rebuilding", folder)
            return None
        sessions = json.loads((gen_dir / "sessions.json").read_text(encoding="utf-8"))
        vectors = np.load(gen_dir / "vectors.npy")
        n = int(manifest["n_vectors"])
        hnsw = hnswlib.Index(space="cosine", dim=idx.embedder.dims)
        hnsw.load_index(str(gen_dir / "lines.hnsw"), max_elements=max(1024, n))
        if vectors.shape != (n, idx.embedder.dims) or hnsw.get_current_count() != n:
            raise ValueError("vector counts disagree")
        for name, raw in sessions.items():
            st = SessionIndex(units=[Unit(t, tid, ts, tok) for t, tid, ts, tok in raw["units"]],
                              labels=[int(x) for x in raw["labels"]])
            for b, e, cid, tokens in raw["spans"]:
                chunk = make_chunk(name, st.units[b:e], None, tokens=int(tokens))
                if chunk.chunk_id != cid:
                    raise ValueError(f"chunk {cid[:12]} of {name} does not match its lines")
                st.spans.append((b, e, cid))
                idx.restore_chunk(chunk)
                idx.set_chunk_labels(cid, st.labels[b:e])
            idx.sessions[name] = st
        if any(max(labs, default=-1) >= n for labs in idx.chunk_labels.values()):
            raise ValueError("the chunk table names vectors that are not there")
        idx.vectors, idx.hnsw, idx.deleted = vectors, hnsw, int(manifest["deleted"])
        marks = {s: FileMark(**m) for s, m in manifest["marks"].items()}
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        log.warning("index of folder %s at %s is unusable (%s): rebuilding", folder, gen_dir,
                    exc)
        return None
    idx.offsets = {s: m.offset for s, m in marks.items()}
    return marks, gen
