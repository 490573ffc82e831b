"""bench/memory.py end to end on a tiny LoCoMo conversation (hashing vectors): it reads the
data, replays the turns, and writes the keys the README and the issue rely on; without
``--data`` it measures on the generated conversations."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (its ``_common``)
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_memory_bench_reports_recall_and_the_ranked_lines(tmp_path, monkeypatch) -> None:
    filler = [{"speaker": "Bo" if i % 2 else "Ann", "dia_id": f"D1:{i + 2}",
               "text": f"We talked about the weather and the trains, day {i}."}
              for i in range(30)]
    conv = {"speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1 pm on 8 May, 2023",
            "session_1": [{"speaker": "Ann", "dia_id": "D1:1",
                           "text": "My sister Lotte plays the cello in Utrecht."}, *filler],
            "qa": [{"question": "Who plays the cello?", "answer": "Lotte",
                    "evidence": ["D1:1"], "category": 4},
                   {"question": "What?", "answer": "-", "evidence": ["D9:9"], "category": 1}]}
    data = tmp_path / "data"
    data.mkdir()
    (data / "1.json").write_text(json.dumps(conv))
    bench = load_bench(monkeypatch)

    out = tmp_path / "out.json"
    assert bench.main(["--data", str(data), "--json", str(out), "--embedder", "hashing",
                       "--root", str(tmp_path / "root")]) == 0
    got = json.loads(out.read_text())
    assert got["questions"] == 1 and got["questions_skipped"] == 1
    for mode in ("hybrid", "bm25"):
        assert got[mode]["recall@1k"] == 1.0 and got[mode]["recall@5"] == 1.0
    assert got["hybrid_ranked_lines"] == {"top25": 1.0, "top50": 1.0, "top100": 1.0,
                                          "top200": 1.0, "all": 1.0}
    assert got["by_category"]["hybrid"]["single-hop"]["questions"] == 1
    assert got["token_ratio"] > 0 and got["config"]["embedder"].startswith("hashing")


def test_the_memory_bench_needs_no_data_folder(tmp_path, monkeypatch) -> None:
    # Without --data it measures on the generated conversations (a small one here).
    from cwm_plugin.testing.conversations.dialogues import generate

    bench = load_bench(monkeypatch)
    monkeypatch.setattr(bench, "default_conversations",
                        lambda: tuple(generate(seed=1, conversations=1, sessions=(3, 3))))

    out = tmp_path / "out.json"
    assert bench.main(["--json", str(out), "--embedder", "hashing", "--skip-sim",
                       "--root", str(tmp_path / "root")]) == 0
    got = json.loads(out.read_text())
    assert got["data"] == "generated" and got["questions"] >= 10
    assert got["questions_skipped"] == 0 and got["hybrid"]["recall@4k"] >= 0.9
