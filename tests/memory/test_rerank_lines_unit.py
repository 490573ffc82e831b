"""``rerank_lines`` and ``RerankStage`` (memory/selection/rerank.py): the best lines ordered
again by a re-ranker's scores, the rest in place, scores kept above them; a re-ranker that
fails or answers the wrong number of scores leaves the first ranking, counted, logged once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from cwm_plugin.memory.index.chunking import Unit
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.selection.lines import Line
from cwm_plugin.memory.selection.rerank import RerankFailed, RerankStage, rerank_lines

pytestmark = pytest.mark.unit


@dataclass
class Judge:
    by_text: dict[str, float]
    top_n: int = 3
    weight: float = 1.0
    name: str = "judge"
    asked: list[list[str]] = field(default_factory=list)
    fail: Exception | None = None

    def scores(self, query: str, texts: list[str]) -> list[float]:
        self.asked.append(texts)
        if self.fail is not None:
            raise self.fail
        return [self.by_text.get(t, 0.0) for t in texts]


def lines(*scores: float) -> list[Line]:
    return [Line("s", i, Unit(f"line {i}", f"t{i}", "", 3), s, {"bm25": s})
            for i, s in enumerate(scores)]


def test_the_top_n_are_ordered_by_the_judge_and_the_rest_keep_their_place() -> None:
    ranked = lines(0.9, 0.8, 0.7, 0.6, 0.5)
    judge = Judge({"line 2": 5.0, "line 0": 1.0, "line 1": -3.0})
    out = rerank_lines(ranked, "q", judge)
    assert [ln.row for ln in out] == [2, 0, 1, 3, 4]
    assert judge.asked == [["line 0", "line 1", "line 2"]]  # only the top 3 asked
    assert out[0].score == pytest.approx(0.9) and out[2].score == pytest.approx(0.7)
    assert min(ln.score for ln in out[:3]) >= max(ln.score for ln in out[3:])
    assert out[0].reasons == {"bm25": 0.7, "rerank": 5.0}
    assert ranked[2].score == 0.7  # the input is not changed


def test_weight_mixes_the_first_ranking_in() -> None:
    ranked = lines(1.0, 0.5, 0.0)
    judge = Judge({"line 2": 1.0, "line 1": 0.0, "line 0": 0.0}, weight=0.4)
    # mixed: 0.6 * (1, 0.5, 0) + 0.4 * (0, 0, 1) = 0.6, 0.3, 0.4
    assert [ln.row for ln in rerank_lines(ranked, "q", judge)] == [0, 2, 1]
    judge.weight = 0.0
    assert [ln.row for ln in rerank_lines(ranked, "q", judge)] == [0, 1, 2]


@pytest.mark.parametrize("answer", [[1.0], [1.0, float("nan"), 0.0]])
def test_a_wrong_answer_is_refused(answer: list[float]) -> None:
    class Odd(Judge):
        def scores(self, query: str, texts: list[str]) -> list[float]:
            return answer

    with pytest.raises(RerankFailed):
        rerank_lines(lines(0.9, 0.8, 0.7), "q", Odd({}))


def test_the_stage_keeps_the_first_ranking_when_the_judge_fails(caplog) -> None:
    metrics = MemoryMetrics()
    stage = RerankStage(metrics.degraded)
    judge = Judge({"line 1": 1.0}, fail=ConnectionError("down"))
    ranked = lines(0.9, 0.8, 0.7)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert stage(ranked, "q", judge) == ranked
    assert metrics.degraded.labels("rerank")._value.get() == 3
    assert sum("re-ranker judge failed" in r.getMessage() for r in caplog.records) == 1
    judge.fail = None  # it answers again: used, and a later failure is logged again
    assert [ln.row for ln in stage(ranked, "q", judge)] == [1, 0, 2]
    judge.fail = TimeoutError("slow")
    with caplog.at_level(logging.WARNING):
        stage(ranked, "q", judge)
    assert sum("re-ranker judge failed" in r.getMessage() for r in caplog.records) == 2
    assert stage(ranked, "   ", judge) == ranked and stage([], "q", judge) == []
    assert stage(ranked, "q", None) == ranked
