"""The model fingerprint follows the weights' content, not just their names and sizes."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from cwm_plugin.connector import fingerprint as fp
from cwm_plugin.connector.fingerprint import model_fingerprint, resolve_model_folder

pytestmark = pytest.mark.unit


def bump_mtime(path) -> None:
    """A rewrite within one coarse clock tick keeps the mtime; make each rewrite visible."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def write(path, data: bytes) -> None:
    path.write_bytes(data)
    bump_mtime(path)


def model_dir(tmp_path, tensors: dict[str, torch.Tensor]):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file(tensors, str(tmp_path / "model.safetensors"))
    bump_mtime(tmp_path / "model.safetensors")
    return tmp_path


def test_a_same_size_fine_tune_changes_a_small_model_s_fingerprint(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    folder = model_dir(tmp_path, w)
    before = model_fingerprint(str(folder))
    size = (folder / "model.safetensors").stat().st_size
    model_dir(tmp_path, {"a": w["a"] + 1e-3, "b": w["b"]})    # same names, shapes, sizes
    assert (folder / "model.safetensors").stat().st_size == size
    assert model_fingerprint(str(folder)) != before


def test_large_safetensors_are_sampled_in_every_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1024)           # force the sampled path
    g = torch.Generator().manual_seed(1)
    w = {f"layer{i}": torch.randn(4096, generator=g) for i in range(4)}
    folder = model_dir(tmp_path, w)
    before = model_fingerprint(str(folder))
    assert fp.file_digest(folder / "model.safetensors").startswith("sampled:")
    assert model_fingerprint(str(folder)) == before            # stable
    tuned = dict(w, layer2=w["layer2"] * 1.01)                 # only one tensor trained
    model_dir(tmp_path, tuned)
    assert model_fingerprint(str(folder)) != before


def test_other_large_weight_files_are_sampled_at_fixed_offsets(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1024)
    (tmp_path / "config.json").write_text("{}")
    data = bytearray(os.urandom(1 << 20))
    write(tmp_path / "pytorch_model.bin", bytes(data))
    before = model_fingerprint(str(tmp_path))
    step = (len(data) - fp.SAMPLE) // (fp.SAMPLES - 1)
    data[10 * step + 7] ^= 0xFF                                # inside the 11th sample window
    write(tmp_path / "pytorch_model.bin", bytes(data))
    assert model_fingerprint(str(tmp_path)) != before


def test_config_changes_count_too(tmp_path):
    folder = model_dir(tmp_path, {"a": torch.zeros(4)})
    before = model_fingerprint(str(folder))
    (folder / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert model_fingerprint(str(folder)) != before


def hub_cache(root, repo: str, commit: str, blob: bytes) -> str:
    """A Hugging Face cache entry as huggingface_hub lays it out; returns the blob's name."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    sha = hashlib.sha256(blob).hexdigest()
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs" / sha).write_bytes(blob)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").symlink_to(f"../../blobs/{sha}")
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return sha


def test_hub_ids_resolve_to_the_cached_snapshot_and_its_checksums(tmp_path, caplog):
    cache = tmp_path / "hub"
    sha = hub_cache(cache, "org/model", "a" * 40, b"weights-v1")
    folder = resolve_model_folder("org/model", None, str(cache))
    assert folder is not None and folder.name == "a" * 40
    assert fp.file_digest(folder / "model.safetensors") == f"sha256:{sha}"  # nothing read
    v1 = model_fingerprint("org/model", cache_dir=str(cache))
    hub_cache(cache, "org/model", "b" * 40, b"weights-v2")     # main moves to a new commit
    assert model_fingerprint("org/model", cache_dir=str(cache)) != v1
    assert model_fingerprint("org/model", "a" * 40, str(cache)) == v1   # a pinned revision
    with caplog.at_level(logging.WARNING):
        assert model_fingerprint("org/absent", "r1", str(cache)) != \
            model_fingerprint("org/absent", "r2", str(cache))
    assert "not on this machine" in caplog.text
