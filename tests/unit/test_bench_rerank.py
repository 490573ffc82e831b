"""bench/rerank.py with its perfect judge (``--judge oracle``: no model served) on a small
LoCoMo conversation whose evidence shares no word with the question: the first ranking leaves
it out of the 1k block, the judge over the best lines brings it in, and the JSON has the keys
the README quotes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
BENCH = Path(__file__).resolve().parents[2] / "bench"


def conversation(tmp_path: Path) -> Path:
    filler = [{"speaker": "Ann" if i % 2 else "Bo", "dia_id": f"D1:{i + 2}",
               "text": f"Ann, the activities club has a list of activities for day {i} "
                       f"and I enjoy reading about activities."}
              for i in range(150)]
    conv = {"speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1 pm on 8 May, 2023",
            "session_1": [{"speaker": "Ann", "dia_id": "D1:1",
                           "text": "I'm off to go swimming with the kids."}, *filler],
            "qa": [{"question": "What activities does Ann enjoy?", "answer": "swimming",
                    "evidence": ["D1:1"], "category": 1}]}
    data = tmp_path / "data"
    data.mkdir()
    (data / "1.json").write_text(json.dumps(conv))
    return data


def load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_rerank", BENCH / "rerank.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_oracle_judge_brings_the_evidence_into_the_budget(tmp_path, monkeypatch) -> None:
    data, out = conversation(tmp_path), tmp_path / "rerank.json"
    assert load_bench(monkeypatch).main([
        "--data", str(data), "--judge", "oracle", "--top-n", "200", "--embedder", "hashing",
        "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["judge"] == "oracle" and got["questions"] == 1 and got["top_n"] == 200
    assert got["recall"]["first"]["1k"] == 0.0
    assert got["recall"]["reranked"]["1k"] == 1.0
    assert got["recall"]["reranked/multi-hop"]["2k"] == 1.0


def test_a_judge_already_served_is_asked_on_its_rerank_endpoint(tmp_path, monkeypatch) -> None:
    """``--url``: the sidecar's own request to a server that is running (here the fake, as a
    cross-encoder behind ``/v1/rerank``), its answer parsed as the sidecar parses it."""
    fake = FakeUpstream(model="judge")
    fake.judge = lambda doc: 0.9 if "swimming" in doc else 0.1
    data, out = conversation(tmp_path), tmp_path / "rerank.json"
    with ServerThread(fake.app) as up:
        assert load_bench(monkeypatch).main([
            "--data", str(data), "--url", up.url, "--kind", "rerank", "--model", "judge",
            "--top-n", "200", "--embedder", "hashing", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["judge"] == f"rerank:judge at {up.url}"
    assert got["recall"]["reranked"]["1k"] == 1.0 and got["recall"]["first"]["1k"] == 0.0
    assert got["rerank_seconds"]["p50"] > 0 and len(fake.bodies("/v1/rerank")) == 1
