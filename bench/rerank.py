"""The memory re-ranker (``memory.rerank``): what it costs a turn, and what it changes.

    python bench/rerank.py [--data DIR] [--questions 80] [--top-n 100] [--json FILE] [--quick]
    python bench/rerank.py --judge oracle --top-n 200 [--data DIR]  # the stage's ceiling
    python bench/rerank.py --url http://HOST:8000 --kind rerank --model NAME  # your own judge

vLLM serves SmolLM2-135M-Instruct (``cwm model smollm2``, this CPU's dtype) with prefix caching
on. The memory is replayed from conversations as ``bench/memory.py`` replays them (the project's
generated ones; LoCoMo's layout with ``--data``). For ``--questions`` questions, evenly spread,
the selection runs without the re-ranker and with it, each at 1k and 2k tokens; the re-ranker
sends exactly the sidecar's request (``cwm_plugin.sidecar.turn.rerank``: ``completions``, one
prompt a line, the instruction and question first, ``max_tokens`` 1, the top log-probabilities)
straight to vLLM. Prints and writes (JSON): the model call's seconds a turn (p50 / p95 / mean:
the latency the stage adds to a turn that selects memory), its prompt tokens a turn, vLLM's
prefix-cache hit share over those prompts (``vllm:prefix_cache_hits`` / ``queries``), and the
evidence recall within each budget with and without, overall and by category. The recall is
indicative only: a 135M chat model is no judge of relevance; the figure to read is the cost.
``--judge oracle`` puts a perfect judge in its place (it knows the evidence lines; no model
served): what the stage can reach with ``--top-n`` lines re-scored, whatever serves it.
``--url`` asks a model server already running instead of SmolLM2 (``--kind completions`` with
``--model`` a chat model, or ``rerank``: a cross-encoder behind vLLM's ``/v1/rerank``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, machine, percentile  # noqa: E402
from memory import CATEGORIES, replay  # noqa: E402

from cwm_plugin.compute_dtype import compute_dtype  # noqa: E402
from cwm_plugin.memory.index.embeddings import HashingEmbedder, MiniLMEmbedder  # noqa: E402
from cwm_plugin.memory.models import MemoryConfig  # noqa: E402
from cwm_plugin.memory.service.service import MemoryService  # noqa: E402
from cwm_plugin.memory.settings import RerankSettings  # noqa: E402
from cwm_plugin.memory.tokens import make_counter  # noqa: E402
from cwm_plugin.sidecar.turn.rerank import prompt_tokens, request, scores_of  # noqa: E402
from cwm_plugin.testing.conversations import locomo  # noqa: E402
from cwm_plugin.testing.conversations.dialogues import default_conversations  # noqa: E402
from cwm_plugin.testing.models import build_smollm2  # noqa: E402
from cwm_plugin.testing.vllm_server import VLLMServer  # noqa: E402

BUDGETS = {"1k": 1024, "2k": 2048}


class DirectReranker:
    """The sidecar's re-rank request sent straight to vLLM; one call a question (the 1k and
    2k selections rank the same lines), its seconds and prompt tokens recorded."""

    weight = 1.0

    def __init__(self, url: str, top_n: int, kind: str = "completions",
                 model: str = "smollm2") -> None:
        self.url, self.top_n, self.kind, self.model = url.rstrip("/"), top_n, kind, model
        self.name = f"{kind}:{model}"
        self.http = httpx.Client(timeout=120)
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self._last: tuple[tuple[str, tuple[str, ...]], list[float]] | None = None

    def scores(self, query: str, texts: list[str]) -> list[float]:
        key = (query, tuple(texts))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        path, body = request(self.kind, self.model, query, texts, "bench-salt")
        t0 = time.perf_counter()
        resp = self.http.post(self.url + path, json=body)
        self.seconds.append(time.perf_counter() - t0)
        resp.raise_for_status()
        data = resp.json()
        self.tokens.append(prompt_tokens(data))
        got = scores_of(self.kind, path, data, len(texts))
        self._last = (key, got)
        return got


class OracleReranker:
    """A perfect judge: 1 for a line holding a question's evidence turn, else 0."""

    name = "oracle"
    weight = 1.0

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n
        self.evidence: list[str] = []  # the evidence turns' texts of the question asked
        self.seconds: list[float] = []
        self.tokens: list[int] = []

    def scores(self, query: str, texts: list[str]) -> list[float]:
        def holds(line: str) -> bool:
            said = line.split(": ", 1)[-1]
            return any(said in ev or ev in said for ev in self.evidence)
        return [1.0 if holds(t) else 0.0 for t in texts]


def prefix_counts(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = defaultdict(float)
    resp = httpx.get(f"{url}/metrics", timeout=30)
    if resp.status_code != 200:  # (a judge that is not vLLM)
        return out
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                out[s.name] += s.value
    return out


def recall(svc: MemoryService, folder: str, question: str, evidence: set[str],
           reranker: Any) -> dict[str, float]:
    msgs = [{"role": "user", "content": question}]
    out = {}
    for name, budget in BUDGETS.items():
        sel = svc.select_context(folder, None, msgs, budget, summary=False, bump=False,
                                 reranker=reranker)
        got = {tid for h in sel.hits for tid in h.turn_ids}
        out[name] = len(got & evidence) / len(evidence)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a folder of LoCoMo conversations (*.json)")
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--top-n", type=int, default=RerankSettings().top_n)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--judge", choices=("smollm2", "oracle"), default="smollm2")
    ap.add_argument("--embedder", choices=("local", "hashing"), default="local")
    ap.add_argument("--url", help="a model server already running to judge (not SmolLM2)")
    ap.add_argument("--kind", choices=("completions", "rerank"), default="completions")
    ap.add_argument("--model", default="smollm2", help="the judge's served name (with --url)")
    ap.add_argument("--quick", action="store_true", help="20 questions")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.questions = 20
    dtype = compute_dtype(args.dtype)
    convs = [c for c in (default_conversations() if args.data is None
                         else locomo.load_conversations(args.data)) if c.qa]
    root = Path(tempfile.mkdtemp(prefix="cwm-bench-rerank-"))
    svc = MemoryService(MemoryConfig(root=root),
                        MiniLMEmbedder(None) if args.embedder == "local" else HashingEmbedder(),
                        make_counter("tiktoken:cl100k_base"))
    n = sum(len(t) for c in convs for _, _, t in c.dated_sessions())
    with tqdm(total=n, desc="replay", unit="turn") as bar:
        for c in convs:
            replay(svc, c.name, c, None, 8192, bar)
    asked = []
    for c in convs:
        known = {str(t["dia_id"]) for _, _, ts in c.dated_sessions() for t in ts}
        asked += [(c.name, q, ev) for q in c.qa
                  if (ev := set(locomo.evidence_ids(q)) & known)]
    step = max(1, len(asked) // args.questions)
    asked = asked[::step][:args.questions]
    texts = {(c.name, str(t["dia_id"])): locomo.turn_text(t) for c in convs
             for _, _, ts in c.dated_sessions() for t in ts}
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def ask_all(rr: Any) -> None:
        for folder, q, ev in tqdm(asked, desc="questions", unit="q"):
            cat = CATEGORIES.get(str(q.get("category")), "all")
            if isinstance(rr, OracleReranker):
                rr.evidence = [texts[folder, e].strip() for e in ev]
            for label, reranker in (("first", None), ("reranked", rr)):
                for budget, v in recall(svc, folder, str(q["question"]), ev, reranker).items():
                    rows[label][budget].append(v)
                    rows[f"{label}/{cat}"][budget].append(v)

    before = after = None
    if args.judge == "oracle":
        rr: Any = OracleReranker(args.top_n)
        ask_all(rr)
    elif args.url:
        rr = DirectReranker(args.url, args.top_n, args.kind, args.model)
        before = prefix_counts(args.url)
        ask_all(rr)
        after = prefix_counts(args.url)
    else:
        server = VLLMServer(model_dir=build_smollm2(), served_name="smollm2", dtype=dtype,
                            max_model_len=2048, kv_cache_gib=2)
        with server:
            rr = DirectReranker(server.base_url, args.top_n)
            rr.scores("warm-up", ["a line", "another line"])  # (the first call's compile)
            rr.seconds.clear()
            rr.tokens.clear()
            before = prefix_counts(server.base_url)
            ask_all(rr)
            after = prefix_counts(server.base_url)
    svc.close()
    cost: dict[str, Any] = {}
    if before is not None and after is not None:
        queries = after["vllm:prefix_cache_queries_total"] - \
            before["vllm:prefix_cache_queries_total"]
        hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        cost = {"rerank_seconds": {"p50": percentile(rr.seconds, 50),
                                   "p95": percentile(rr.seconds, 95),
                                   "mean": sum(rr.seconds) / len(rr.seconds)},
                "rerank_prompt_tokens": {"p50": percentile(rr.tokens, 50),
                                         "mean": sum(rr.tokens) / len(rr.tokens)},
                "prefix_cache_hit_share": hits / queries if queries else None}
    result = {
        "judge": "oracle" if args.judge == "oracle" else
        (f"{args.kind}:{args.model} at {args.url}" if args.url else "SmolLM2-135M-Instruct"),
        "dtype": dtype, "top_n": args.top_n, "questions": len(asked),
        "data": str(args.data) if args.data else "generated", **cost,
        "recall": {label: {b: round(sum(v) / len(v), 4) for b, v in by.items()}
                   for label, by in sorted(rows.items())},
        "machine": machine(), "load_average": load_average(),
    }
    if cost:
        print(json.dumps(cost, indent=1))
    for label, by in sorted(result["recall"].items()):
        print(f"{label:28s} " + "  ".join(f"{b} {v:.3f}" for b, v in by.items()))
    if cost:
        print(f"re-rank call a turn: p50 {cost['rerank_seconds']['p50']:.3f} s, "
              f"{cost['rerank_prompt_tokens']['mean']:.0f} prompt tokens ({args.top_n} lines); "
              f"recall is indicative only (a 135M model judging)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
