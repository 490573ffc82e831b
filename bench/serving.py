"""Serving under load: N users' multi-round QA sessions (LMCache's multi-round QA benchmark's
shape) streamed at a target rate to vLLM alone, vLLM + LMCache and vLLM + our connector (CPU,
disk, Redis tiers), with vLLM's own KV cache holding only a fraction of the users' KV.

    python bench/serving.py [--json bench/results/serving.json] [--quick]

Each config runs in a fresh ``vllm serve`` of the real SmolLM2-135M (bf16 where the CPU has
bf16 arithmetic, else float32), block size 128, the same workload and seed
(bench/_serving_workload.py: shared system prompt, a conversation context per user, R rounds of
A-token answers, arrivals at ``--qps``); bench/_serving_configs.py says what each config is and
how vLLM's cache is sized (``--kv-fraction`` of the users' KV after the main rounds;
``--store JSON``: settings over our configs' store, e.g. ``{"zstd_level": 0}``).
Per config: TTFT p50/p95/p99 (all, and returning rounds), ITL p50/p99, completed requests and
output tokens a second, vLLM's external and own prefix-cache hit tokens, failed requests. Then:

* the floor: one user's returning round alone, vLLM's own prefix hit (on the first server);
  the TTFT objective of the sweep is ``--slo-x`` times it;
* a sweep over the number of users at the same per-user rate on ``--sweep-configs``: the most
  users served with returning TTFT p95 within the objective (LMCache's headline measure); a
  larger N is left out once a smaller one missed it while saturated. A config's peak
  requests/s is the most it completed in any phase of the run: the sweep's points, or the
  ``saturated`` phase after the main rounds, where the main users send their next
  ``--saturated-rounds`` rounds in a closed loop (all returning, KV evicted from vLLM, the
  server never idle; a full run plays enough of them that the phase's requests/s is steady);
  the requests/s goals compare those;
* ``fits``: the same workload on vLLM with a cache that holds every user (the ITL reference);
* the greedy check: sample sessions' last turn on ``cwm_cpu``, restored from the CPU tier
  after dropping vLLM's prefix cache, vs the session replayed round by round under a fresh
  salt (a recompute-only run), and vs its last prompt in one piece;
* faults under load (bench/_serving_faults.py), each a round with failed requests and ITL p99
  against its fault-free round;
* a Redis Cluster run (bench/_serving_cluster.py): the shipped Redis config on a real
  3-master cluster, each master's share of the commands.

The command line, with each size's full and ``--quick`` value: bench/_serving_args.py.

A table with ratios against ``vllm`` and ``lmcache`` of this run and the issue's goals are
printed; the JSON (``--json``) names the machine, the load average and the commit with the
files that differed from it. ``--quick``: 4 users, 3 rounds, 600-token contexts, 2 sweep
points on 2 configs; every part still runs (about ten vLLM starts).
Exit status 1 if a part failed to run (the goals are reported, not enforced).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _serving_cluster as cluster
import _serving_faults as faults
import _serving_report as report
from _common import load_average, machine, write_json
from _serving_args import parse
from _serving_configs import (
    RETURNING_PRIORITY,
    SERVED,
    Servers,
    Sizes,
    grew,
    hit_counters,
    kv_bytes_per_token,
)
from _serving_workload import Request, Runner, Session, WorkloadSpec, build_sessions
from tqdm import tqdm

from cwm_plugin.testing.conversations.prompts import conversation_lines
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.redis_server import RedisServer

log = logging.getLogger("bench.serving")



def texts() -> tuple[list[str], list[str]]:
    """Lines of the generated conversations and their questions (the users' contexts and
    turns)."""
    from cwm_plugin.testing.conversations.dialogues import default_conversations

    questions = [q["question"] for c in default_conversations() for q in c.qa]
    return list(conversation_lines()), questions


def code_state() -> dict[str, Any]:
    """The commit measured and the files that differed from it (the servers run the tree)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout
    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no",
                                              "cwm_plugin").splitlines()]}


class Bench:
    """One run: its phases against the servers, and what they measured (``out``)."""

    def __init__(self, args: argparse.Namespace, spec: WorkloadSpec, servers: Servers,
                 tokenizer: Any, lines: list[str], questions: list[str]) -> None:
        self.args, self.spec, self.servers = args, spec, servers
        self.tok, self.lines, self.questions = tokenizer, lines, questions
        self.out: dict[str, Any] = {"configs": {}, "fault_rounds": {}, "errors": {}}
        self.sweep: dict[str, dict[int, dict[str, Any]]] = {}
        self.faults = faults.FaultRounds(self)

    def sessions(self, tag: str, users: int | None = None) -> list[Session]:
        return build_sessions(self.spec, self.tok, self.lines, self.questions, tag=tag,
                              users=users)

    def play(self, url: str, sessions: list[Session], rounds: int, phase: str, *,
             spec: WorkloadSpec | None = None, salted: bool = True, api_key: str = "none",
             action: faults.Action | None = None, at_s: float = 0.0,
             returning_priority: int | None = None) -> list[Request]:
        """Run ``rounds`` rounds of ``sessions`` against ``url`` (with a fault, if given;
        ``returning_priority``: see :class:`Runner`)."""
        from openai import AsyncOpenAI

        bar = tqdm(total=len(sessions) * rounds, desc=phase, unit="req", leave=False)

        async def go() -> list[Request]:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                                 timeout=900)
            runner = Runner(client, SERVED, spec or self.spec, salted=salted,
                            on_done=lambda r: bar.update(),
                            returning_priority=returning_priority)
            try:
                return await faults.round_with(runner, sessions, rounds, phase, action, at_s)
            finally:
                await client.close()
        try:
            reqs = asyncio.run(go())
        finally:
            bar.close()
        s = report.summarize(reqs)
        log.info("%s: %d requests, %d failed, returning TTFT p95 %.3fs, ITL p99 %.3fs, "
                 "%.2f req/s", phase, s["requests"], s["failed_requests"],
                 s["returning_ttft_p95_s"], s["itl_p99_s"], s["requests_per_s"])
        return reqs

    def warm(self, url: str, tag: str) -> None:
        """One unmeasured request (other text, other salt): first-request costs paid."""
        s = build_sessions(dataclasses.replace(self.spec, seed=self.spec.seed + 999),
                           self.tok, self.lines, self.questions, tag=f"warm-{tag}", users=1)
        self.play(url, s, 1, f"warm-{tag}", spec=dataclasses.replace(self.spec, qps=0))

    def phase(self, server: Any, sessions: list[Session], rounds: int, phase: str,
              url: str | None = None, **kw: Any) -> dict[str, Any]:
        """A measured phase against ``url`` (default: ``server``), with ``server``'s counters."""
        before = hit_counters(server)
        reqs = self.play(url or server.base_url, sessions, rounds, phase, **kw)
        offered = (kw.get("spec") or self.spec).qps
        return {**report.summarize(reqs), "offered_requests_per_s": offered,
                "load_average": load_average(),
                **grew(before, hit_counters(server)), "timeline": report.timeline(reqs)}

    def floor(self, server: Any) -> None:
        """One user alone, rounds 1.. served from vLLM's own prefix cache: the TTFT floor."""
        closed = dataclasses.replace(self.spec, qps=0)
        s = build_sessions(dataclasses.replace(self.spec, seed=self.spec.seed + 1), self.tok,
                           self.lines, self.questions, tag="floor", users=1)
        reqs = self.play(server.base_url, s, 4, "floor", spec=closed)
        ttfts = [r.ttft for r in reqs if r.returning and r.ttft is not None]
        self.out["floor_ttft_s"] = statistics.median(ttfts) if ttfts else math.nan
        self.out["slo_ttft_s"] = self.args.slo_x * self.out["floor_ttft_s"]

    def config(self, name: str, redis: faults.RedisHolder, proxy: Any) -> None:
        with self.servers.serve(name, redis_url=redis.url) as server:
            self.warm(server.base_url, name)
            if "floor_ttft_s" not in self.out:     # on the first server (vllm's)
                self.floor(server)
            runs, sats, main = [], [], []
            prio = RETURNING_PRIORITY.get(name)
            for k in range(self.args.repeat):
                main = self.sessions(f"main{k}")
                runs.append(self.phase(server, main, self.spec.rounds, f"{name}-main{k}",
                                       returning_priority=prio))
                sats.append(self.saturated(name, server, main, prio))
            self.out["configs"][name] = {**report.median_of(runs),
                                         **({"repeats": runs} if len(runs) > 1 else {})}
            self.out["configs"][name]["saturated"] = {
                **report.median_of(sats), **({"repeats": sats} if len(sats) > 1 else {})}
            if "sweep" in self.args.parts and name in self.args.sweep_configs:
                self.sweep_points(name, server)
            if name == "cwm_cpu" and "greedy" in self.args.parts:
                self.guard("greedy", self.greedy, server, main)
        if name == "cwm_redis" and "faults" in self.args.parts:
            self.guard("faults", self.faults.redis_faults, main, redis, proxy)
        if name == "cwm_redis" and "tiny_budgets" in self.args.parts:
            self.guard("tiny_budgets", self.faults.tiny_budgets, main, redis)

    def saturated(self, name: str, server: Any, sessions: list[Session],
                  returning_priority: int | None = None) -> dict[str, Any]:
        """The main users' next rounds in a closed loop (each sends again as soon as its answer
        is in): every request a returning one whose KV vLLM has evicted, the server kept busy.
        Its completed requests/s is the config's throughput for returning sessions (with
        ``--repeat``, each main phase's users go on to their own saturated phase: the median)."""
        closed = dataclasses.replace(self.spec, qps=0)
        sat = self.phase(server, sessions, self.args.saturated_rounds, f"{name}-saturated",
                         spec=closed, returning_priority=returning_priority)
        return {k: v for k, v in sat.items() if k != "timeline"}

    def result(self, load_before: list[float], t_start: float, work: Path) -> dict[str, Any]:
        """The JSON of the run so far: figures, sweep, goals, machine, workload, sizes."""
        out, spec, args = dict(self.out), self.spec, self.args
        slo = out.get("slo_ttft_s", math.nan)
        out["sweep"] = {"users": sorted({n for p in self.sweep.values() for n in p}),
                        "slo_ttft_s": slo, "slo_x_floor": args.slo_x,
                        "per_user_rate": spec.qps / spec.users,
                        "points": {k: {str(n): {m: p[m] for m in report.KEYS if m in p}
                                       for n, p in sorted(v.items())}
                                   for k, v in self.sweep.items()},
                        "most_users_within_slo": {k: report.most_users_within(v, slo)
                                                  for k, v in self.sweep.items()}}
        for name, c in out["configs"].items():
            c["peak_requests_per_s"] = max(
                [p["requests_per_s"] for p in self.sweep.get(name, {0: c}).values()]
                + [c.get("saturated", {}).get("requests_per_s", 0.0)])
        out["goals"] = report.goals(out["configs"], out.get("fits"), {
            k: v for k, v in out["fault_rounds"].items() if k != "none"})
        if g := out.get("greedy_check"):
            same = sum(o["identical"] for o in g["sessions"])
            out["goals"]["greedy_last_turns_identical_to_recompute"] = report.goal(
                same / max(1, len(g["sessions"])), 1.0, False)
        out.update(machine=machine(), load_average={"before": load_before,
                                                    "after": load_average()},
                   model="SmolLM2-135M-Instruct", dtype=args.dtype, quick=args.quick,
                   workload={**dataclasses.asdict(spec), "gap_s": spec.gap_s,
                             "fault_rounds": args.fault_rounds, "repeat": args.repeat,
                             "max_num_batched_tokens": args.max_num_batched_tokens,
                             "long_prefill_token_threshold":
                                 args.long_prefill_token_threshold,
                             "store_override": args.store},
                   sizes=self.servers.sizes.as_dict(),
                   wall_s=round(time.monotonic() - t_start, 1), code=code_state(),
                   work_dir=str(work))
        return out

    def sweep_points(self, name: str, server: Any) -> None:
        """More users at the same per-user rate, fewest first; larger N are left out once a
        smaller one missed the objective while saturated (they can only do worse)."""
        pts = self.sweep[name] = {self.spec.users: self.out["configs"][name]}
        for n in sorted({*self.args.sweep_users, self.spec.users}):
            if n in pts:
                continue
            if report.saturated_miss(pts, n, self.out["slo_ttft_s"]):
                log.info("%s: sweep point N=%d left out (a smaller N missed the objective "
                         "while saturated)", name, n)
                continue
            spec = dataclasses.replace(self.spec, qps=self.spec.qps * n / self.spec.users)
            pts[n] = self.phase(server, self.sessions(f"sweep{n}", n), self.spec.rounds,
                                f"{name}-sweep{n}", spec=spec)

    def fits(self) -> None:
        """The ITL reference: the main workload on vLLM with room for every user."""
        with self.servers.serve("fits") as server:
            self.warm(server.base_url, "fits")
            self.out["fits"] = self.phase(server, self.sessions("main0"), self.spec.rounds,
                                          "fits-main")

    def guard(self, part: str, fn: Any, *a: Any) -> None:
        """Run one part; a failure is logged and kept in the JSON, the run goes on."""
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed", part)
            self.out["errors"][part] = f"{type(e).__name__}: {e}"

    def greedy(self, server: Any, sessions: list[Session]) -> None:
        """Sample sessions' last turn restored from the CPU tier against two recomputes under
        fresh salts: the session replayed round by round (a recompute-only run: each round's
        prompt computed afresh and its answer decoded, as the workload computed it) and the
        whole prompt in one piece. In bfloat16 a token's KV computed while decoding differs in
        its last bits from the same token's KV computed in a prefill, so only the replay is
        the like-for-like reference; the one-piece match is reported beside it."""
        kw = {"max_tokens": self.spec.answer_tokens, "ignore_eos": True,
              "min_tokens": self.spec.answer_tokens, "return_token_ids": True}

        def ids(messages: list[dict[str, str]], salt: str) -> list[int]:
            return server.chat(messages, cache_salt=salt, **kw)["choices"][0]["token_ids"]

        out = []
        for s in sessions[:self.args.greedy_sessions]:
            messages = s.messages[:-1]             # the last turn's prompt
            server.reset_prefix_cache()            # vLLM's own cache: the next one restores
            h0 = hit_counters(server)["external_hit_tokens"]
            restored = server.chat(messages, cache_salt=s.salt, **kw)
            h1 = hit_counters(server)["external_hit_tokens"]
            replay_salt = f"{s.salt}-replay-{secrets.token_hex(4)}"
            for i, m in enumerate(messages[:-1]):
                if m["role"] == "user":
                    ids(messages[:i + 1], replay_salt)
            replayed = ids(messages, replay_salt)
            one_piece = ids(messages, f"{s.salt}-cold-{secrets.token_hex(4)}")
            h2 = hit_counters(server)["external_hit_tokens"]
            a = restored["choices"][0]["token_ids"]
            out.append({"session": s.name, "prompt_tokens": restored["usage"]["prompt_tokens"],
                        "restored_tokens": h1 - h0, "recompute_hits": h2 - h1,
                        "identical": a == replayed, "identical_to_one_piece": a == one_piece,
                        "first_divergence_from_one_piece": next(
                            (k for k, (x, y) in enumerate(zip(a, one_piece, strict=True))
                             if x != y), None),
                        "workload_answer_identical":
                            restored["choices"][0]["message"]["content"]
                            == s.messages[-1]["content"]})
        self.out["greedy_check"] = {
            "sessions": out, "all_identical": all(o["identical"] for o in out),
            "all_restored": all(o["restored_tokens"] > 0 and o["recompute_hits"] == 0
                                for o in out),
            "how": "last turn on cwm_cpu after dropping vLLM's prefix cache (restored from "
                   "the CPU tier) vs the session replayed round by round under a fresh salt "
                   "(recompute only; 'identical') and vs its last prompt in one piece under "
                   "another fresh salt, one at a time, temperature 0"}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv, __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers import AutoTokenizer

    load_before = load_average()
    t_start = time.monotonic()
    model = build_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    lines, questions = texts()
    spec = WorkloadSpec(users=args.users, rounds=args.rounds, answer_tokens=args.answer_tokens,
                        system_tokens=args.system_tokens, context_tokens=args.context_tokens,
                        qps=args.qps, think_s=args.think_s, seed=args.seed)
    # the longest a user's prompt gets: the main and saturated rounds, then 5 fault rounds
    # on cwm_redis
    longest = spec.prompt_tokens_after(spec.rounds + args.saturated_rounds +
                                       5 * args.fault_rounds) + spec.answer_tokens
    sizes = Sizes(users=spec.users, user_tokens=spec.prompt_tokens_after(spec.rounds),
                  kv_bytes_per_token=kv_bytes_per_token(model, args.dtype),
                  fraction=args.kv_fraction, max_model_len=128 * math.ceil(longest / 128 + 1))
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-serving-", dir=Path.home()))
    everyone = spec.users * args.repeat + sum(args.sweep_users) + 4
    bench = Bench(args, spec, Servers(model, args.dtype, sizes, work, everyone,
                                         args.max_num_batched_tokens, args.store,
                                         args.long_prefill_token_threshold), tok, lines,
                  questions)
    log.info("sizes: %s", sizes.as_dict())
    redis = faults.RedisHolder(RedisServer().start())
    proxy = faults.ProxyProcess(redis.port).start()
    meta = {"load_before": load_before, "t_start": t_start, "work": work}
    parts = [(name, bench.config, (name, redis, proxy)) for name in args.configs]
    parts += [(p, fn, a) for p, fn, a in (("fits", bench.fits, ()),
                                           ("sidecar", bench.faults.sidecar, (redis,)),
                                           ("cluster", cluster.run, (bench,)))
              if p in args.parts]
    try:
        for part, fn, a in tqdm(parts, desc="parts", unit="part"):
            bench.guard(part, fn, *a)
            write_json(args.json, {**bench.result(**meta), "complete": False})
    finally:
        proxy.stop()
        redis.stop()
    out = {**bench.result(**meta), "complete": True}
    write_json(args.json, out)
    print(report.render(out, bench.sweep))
    for part, err in out["errors"].items():
        print(f"PART FAILED: {part}: {err}", file=sys.stderr)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
