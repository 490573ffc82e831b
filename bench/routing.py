"""Routing over replicas: the multi-round chat workload of bench/serving.py through the sidecar
and a real ``vllm-router`` over 2 real vLLM replicas (our connector on each, the shared Redis
tier, vLLM's KV events on), one run per router policy, then a replica killed mid-run.

    python bench/routing.py [--json bench/results/routing.json] [--quick]

The users run a closed loop (each sends its next round ``--think-s`` after its answer; every
first round at once), so a policy that places by load sees the sessions arrive together.

Policies (each on fresh replicas, a fresh Redis and a fresh sidecar: every cache empty):

* ``round_robin``, ``consistent_hash`` (on ``X-Session-Id``, the session's routing key the
  sidecar sends), ``cache_aware`` (the router's text tree);
* ``kv_aware``: vLLM's own KV events alone (our tier events off: ``tier_events: false``);
* ``kv_aware_tiers``: our tiers in the events too, and the router's session affinity, as
  configs/router/vllm-router.sh ships it;
* ``kv_aware_affinity`` (full run only): vLLM's events alone with the same affinity, which
  separates what affinity does from what the tier events do.

vllm-router 0.1.17 gives a request with a ``cache_salt`` (every request through the sidecar) no
prefix credit (docs/router.md): the router's logged decisions are counted per policy
(``decisions``) so that what steered each request is visible.

Per policy: ``hit_fraction`` (vLLM's prefix-cache hits plus the connector's external hits,
over the tokens a returning round could hit: its previous round's prompt and answer in whole
128-token blocks; a first round can hit nothing, every session having its own salt), its
``prefix_`` (the replica's own cache) and ``external_`` (restored by the connector: the
replica's CPU tier or the shared Redis) shares, the returning rounds' TTFT p50/p95,
``max_replica_share`` (the most requests one replica completed, of all), failed requests.
Then ``kill``: on the ``kv_aware_tiers`` cluster, more rounds with the replica that served more
of them SIGKILLed a third of the way in, once it is running a request (a stream cut
mid-answer): failed and truncated requests, streams the sidecar resumed, external hits on the
survivor. Then ``simulation`` (bench/_routing_sim.py): the policies over 8, 32 and 128
replicas with thousands of users, fed with this run's costs, and at 32 with a hot tenant.

``--quick``: 4 users, 3 rounds, 600-token contexts, the five policies and the kill (about eight
minutes on 2 cores). The goals are reported, not enforced; exit status 1 if a part failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _routing_sim as sim
import _serving_faults as faults
import _serving_report as report
from _common import load_average, machine, write_json
from _serving_configs import (
    BLOCK,
    SERVED,
    Servers,
    Sizes,
    connector_args,
    grew,
    hit_counters,
    kv_bytes_per_token,
    shipped_redis,
)
from _serving_workload import Request, WorkloadSpec
from serving import Bench, code_state, texts

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.procs import free_port
from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_router import VllmRouter
from cwm_plugin.testing.vllm_server import start_all

log = logging.getLogger("bench.routing")
FULL = {"users": 8, "rounds": 5, "context_tokens": 1200, "kill_rounds": 2}
QUICK = {"users": 4, "rounds": 3, "context_tokens": 600, "kill_rounds": 2}
# name: (router policy, vLLM's events to the router, our tier events, session affinity)
POLICIES = {"round_robin": ("round_robin", False, False, False),
            "consistent_hash": ("consistent_hash", False, False, False),
            "cache_aware": ("cache_aware", False, False, False),
            "kv_aware": ("kv_aware", True, False, False),
            "kv_aware_tiers": ("kv_aware", True, True, True),
            "kv_aware_affinity": ("kv_aware", True, False, True)}
QUICK_POLICIES = ("round_robin", "consistent_hash", "cache_aware", "kv_aware", "kv_aware_tiers")
# what configs/router/vllm-router.sh sets beside the policy: the circuit breaker that sends
# retries to a live replica, health checks (faster here: the run is short)
ROUTER_FLAGS = ["--cb-failure-threshold", "2", "--health-check-interval-secs", "2"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/routing.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policies", nargs="*", choices=list(POLICIES))
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"full {v}; quick {QUICK[k]}")
    ap.add_argument("--qps", type=float, default=0.0,
                    help="offered requests/s; 0 (the default): a closed loop, every user's "
                         "first round at once (so a load-placing policy sees them together)")
    ap.add_argument("--think-s", type=float, default=2.0,
                    help="between an answer and the user's next round")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--kv-fraction", type=float, default=1.0,
                    help="of every user's KV that each replica's own cache holds")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.policies = args.policies or list(QUICK_POLICIES if args.quick else POLICIES)
    args.dtype = compute_dtype(args.dtype)
    return args


def possible_tokens(reqs: list[Request], answer_tokens: int) -> int:
    """What the returning rounds could hit: each one's previous round's prompt and answer
    (its KV, less the last token's), in whole blocks, and never more than the blocks before
    its own last prompt token."""
    last: dict[str, Request] = {}
    total = 0
    for r in sorted(reqs, key=lambda r: r.sent):
        prev = last.get(r.user)
        if r.ok and prev is not None and prev.ok and r.prompt_tokens:
            held = prev.prompt_tokens + answer_tokens - 1
            total += min(held // BLOCK, (r.prompt_tokens - 1) // BLOCK) * BLOCK
        last[r.user] = r
    return total


class Cluster:
    """Two replicas (our connector, the shared Redis, KV events), a router, a sidecar."""

    def __init__(self, bench: Bench, redis: RedisServer, name: str) -> None:
        self.bench, self.redis, self.name = bench, redis, name
        self.policy, self.events, self.tiers, self.affinity = POLICIES[name]
        work = bench.servers.work
        # vLLM binds only a wildcard endpoint (it connects to a named host) and the router
        # takes tcp://HOST:PORT only: each replica publishes on every interface, on a free port
        ports = [free_port() for _ in range(2)]
        self.endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
        self.replicas = []
        for i, port in enumerate(ports):
            ep = f"tcp://*:{port}"
            extra = shipped_redis(redis.url, work / f"disk-{name}-{i}")
            extra["tier_events"] = self.tiers
            events = ["--kv-events-config",
                      f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                      f'"endpoint": "{ep}", "topic": ""}}'] if self.events else []
            self.replicas.append(bench.servers.vllm([*connector_args(extra), *events]))
        self.router: VllmRouter | None = None
        self.sidecar: Any = None
        self.key = secrets.token_hex(16)

    def router_args(self) -> list[str]:
        out = list(ROUTER_FLAGS)
        if self.events:
            for r, ep in zip(self.replicas, self.endpoints, strict=True):
                out += ["--kv-event-source", f"{r.base_url}={ep}"]
            out += ["--kv-event-model", SERVED, "--kv-event-block-size", str(BLOCK)]
        if self.affinity:
            out += ["--kv-aware-session-affinity-ttl-secs", "3600"]
        return out

    def __enter__(self) -> Cluster:
        from cwm_plugin.sidecar.identity.authenticator import hash_key
        from cwm_plugin.testing.sidecar_process import SidecarProcess

        redis = self.redis.client()
        try:
            redis.flushall()
        finally:
            redis.close()
        servers = self.bench.servers
        try:
            start_all(*self.replicas)
            self.router = VllmRouter([r.base_url for r in self.replicas], policy=self.policy,
                                     args=self.router_args(), debug=self.policy == "kv_aware",
                                     env={"VLLM_ROUTER_TOKENIZER": str(servers.model)}).start()
            cfg = faults.sidecar_yaml(servers.work / f"sidecar-{self.name}.yaml", servers.model,
                                      {"router": self.router.url}, hash_key(self.key), SERVED,
                                      balancer=True)
            self.sidecar = SidecarProcess(cfg, None, servers.work,
                                          secrets.token_hex(32)).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sidecar is not None:
            self.sidecar.stop()
        if self.router is not None:
            self.router.stop()
        for r in self.replicas:
            r.stop()

    def counters(self) -> list[dict[str, float]]:
        out = []
        for r in self.replicas:
            if not r.alive():
                out.append({})
                continue
            c = hit_counters(r)
            c["requests"] = r.metric("vllm:request_success")
            out.append(c)
        return out

    def play(self, sessions: list, rounds: int, phase: str, **kw: Any) -> dict[str, Any]:
        """``rounds`` rounds through the sidecar: the figures of the phase."""
        before = self.counters()
        decided = len(self.router.decisions()) if self.policy == "kv_aware" else 0
        reqs = self.bench.play(self.sidecar.url, sessions, rounds, phase, salted=False,
                               api_key=self.key, **kw)
        after = self.counters()
        per = [grew(b, a) if a else {} for b, a in zip(before, after, strict=True)]
        done = [p.get("requests", 0.0) for p in per]
        possible = possible_tokens(reqs, self.bench.spec.answer_tokens)
        prefix = sum(p.get("prefix_hit_tokens", 0.0) for p in per)
        external = sum(p.get("external_hit_tokens", 0.0) for p in per)
        s = report.summarize(reqs)
        out = {"hit_fraction": (prefix + external) / possible if possible else math.nan,
               "prefix_hit_fraction": prefix / possible if possible else math.nan,
               "external_hit_fraction": external / possible if possible else math.nan,
               "possible_hit_tokens": possible, "prefix_hit_tokens": prefix,
               "external_hit_tokens": external,
               "ttft_p50_s": s["returning_ttft_p50_s"], "ttft_p95_s": s["returning_ttft_p95_s"],
               "all_ttft_p50_s": s["ttft_p50_s"], "all_ttft_p95_s": s["ttft_p95_s"],
               "first_round_ttft_p50_s": report.percentile(
                   [r.ttft for r in reqs if r.ok and not r.returning and r.ttft], 50),
               "requests_per_replica": done,
               "max_replica_share": max(done) / sum(done) if sum(done) else math.nan,
               "failed_requests": s["failed_requests"], "requests": s["requests"],
               "returning_requests": sum(1 for r in reqs if r.ok and r.returning),
               "errors": s["errors"], "load_errors": sum(p.get("load_errors", 0.0)
                                                         for p in per),
               "first_round_prompt_tokens": statistics.median(
                   [r.prompt_tokens for r in reqs if not r.returning and r.prompt_tokens]
                   or [0]),
               "duration_s": s["duration_s"], "load_average": load_average()}
        if self.policy == "kv_aware":
            got = self.router.decisions()[decided:]
            out["decisions"] = dict(Counter(d.get("outcome", "?") for d in got))
            out["credited_prefix_tokens"] = sum(int(d.get("credited_prefix_tokens", 0) or 0)
                                                for d in got)
        return out

    def resumed(self) -> float:
        """Streams the sidecar resumed after their replica died
        (``cwm_sidecar_streams_resumed_total``)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.sidecar.url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {self.key}"}).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "cwm_sidecar_streams_resumed_total")


def kill_mid_answer(server: Any, wait_s: float = 60.0) -> faults.Action:
    """SIGKILL ``server`` once it is running a request (so a stream is cut mid-answer), or
    after ``wait_s`` seconds whatever it does."""
    kill = faults.kill_server(server)

    def act(done: Any) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not done.is_set():
            try:
                if server.metric("vllm:num_requests_running") >= 1:
                    break
            except Exception:  # noqa: BLE001 -- a metrics hiccup: look again
                pass
            time.sleep(0.02)
        kill(done)
    return act


def run_policy(bench: Bench, redis: Any, name: str, args: argparse.Namespace,
               out: dict[str, Any]) -> None:
    log.info("policy %s", name)
    with Cluster(bench, redis, name) as cl:
        warm = bench.play(cl.sidecar.url, bench.sessions(f"warm-{name}", 1), 1,
                          f"warm-{name}", salted=False, api_key=cl.key,
                          spec=dataclasses.replace(bench.spec, qps=0))
        main = bench.sessions(f"{name}-main")
        got = cl.play(main, bench.spec.rounds, name)
        # a first round alone (cold, nothing else running): the simulator's prefill cost
        got.update(alone_ttft_s=warm[0].ttft, alone_prompt_tokens=warm[0].prompt_tokens)
        out["policies"][name] = got
        if name == "kv_aware_tiers" and args.kill_rounds:
            at = got["duration_s"] * args.kill_rounds / bench.spec.rounds / 3
            busiest = max(range(2), key=lambda i: got["requests_per_replica"][i])
            kill = cl.play(main, args.kill_rounds, "kill",
                           action=kill_mid_answer(cl.replicas[busiest]), at_s=at)
            kill.update(killed_at_s=at, killed_replica=busiest, streams_resumed=cl.resumed(),
                        survivor_external_hit_tokens=kill["external_hit_tokens"])
            out["kill"] = kill


def costs_of(policies: dict[str, Any]) -> sim.Costs:
    """The simulator's costs from this run: a prefill token's seconds from each cluster's
    first request (a cold first round, alone), the base from the most local policy's
    returning rounds (under the run's load), a shared-tier token's from round robin's
    (partly restored) returning rounds; a local tier's a third of that (bench/ttft.py's CPU
    tier against Redis)."""
    alone = [p["alone_ttft_s"] / p["alone_prompt_tokens"] for p in policies.values()
             if p.get("alone_ttft_s") and p.get("alone_prompt_tokens")]
    prefill = statistics.median(alone) if alone else sim.Costs().prefill_s_per_token
    local = max(policies.values(), key=lambda p: p.get("prefix_hit_fraction") or 0.0)
    base = local.get("ttft_p50_s") or sim.Costs().base_s
    rr = policies.get("round_robin")
    shared = sim.Costs().shared_s_per_token
    if rr and rr.get("external_hit_tokens") and rr.get("returning_requests"):
        per_request = rr["external_hit_tokens"] / rr["returning_requests"]
        shared = max(1e-7, (rr["ttft_p50_s"] - base) / max(1.0, per_request))
    return sim.Costs(base_s=base, prefill_s_per_token=prefill,
                     restore_s_per_token=shared / 3, shared_s_per_token=shared)


def goals(out: dict[str, Any]) -> dict[str, Any]:
    p, g = out["policies"], {}
    tiers, rr = p.get("kv_aware_tiers"), p.get("round_robin")
    if tiers:
        g["kv_aware_tiers_hit_fraction_ge_0.95"] = tiers["hit_fraction"] >= 0.95
        g["no_replica_over_65pct"] = tiers["max_replica_share"] <= 0.65
        if rr:
            g["ttft_p95_le_0.5x_round_robin"] = tiers["ttft_p95_s"] <= 0.5 * rr["ttft_p95_s"]
    if k := out.get("kill"):
        g["kill_no_failed_request"] = k["failed_requests"] == 0
        g["kill_survivor_restored"] = k["survivor_external_hit_tokens"] > 0
    if s := out.get("simulation_hot_tenant"):
        t, a = s["32"]["kv_aware_tiers"], s["32"]["consistent_hash"]
        g["sim_32_hot_max_over_mean_le_1.3"] = t["max_over_mean"] <= 1.3
        g["sim_32_hot_local_hits_within_10pct_of_affinity"] = \
            t["local_hit_fraction"] >= 0.9 * a["local_hit_fraction"]
    return g


def render(out: dict[str, Any]) -> str:
    cols = ["hit_fraction", "prefix_hit_fraction", "external_hit_fraction", "ttft_p50_s",
            "ttft_p95_s", "max_replica_share", "failed_requests"]
    lines = ["policy".ljust(18) + "".join(c[:14].rjust(15) for c in cols)]
    for name, p in out["policies"].items():
        lines.append(name.ljust(18) + "".join(
            (f"{p[c]:.3f}" if isinstance(p[c], float) else str(p[c])).rjust(15) for c in cols))
    if k := out.get("kill"):
        lines.append(f"kill: failed {k['failed_requests']}, resumed {k['streams_resumed']:.0f},"
                     f" survivor external hits {k['survivor_external_hit_tokens']:.0f} tokens")
    for label in ("simulation", "simulation_hot_tenant"):
        for n, pol in (out.get(label) or {}).items():
            lines.append(f"{label} {n}: " + ", ".join(
                f"{k} {v['local_hit_fraction']:.2f}/{v['max_over_mean']:.2f}"
                for k, v in pol.items()) + "  (local hits / max over mean)")
    lines.append(f"goals: {out['goals']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers import AutoTokenizer

    t0, load0 = time.monotonic(), load_average()
    model = build_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    lines, questions = texts()
    spec = WorkloadSpec(users=args.users, rounds=args.rounds, answer_tokens=args.answer_tokens,
                        context_tokens=args.context_tokens, qps=args.qps,
                        think_s=args.think_s)
    longest = spec.prompt_tokens_after(spec.rounds + args.kill_rounds) + spec.answer_tokens
    sizes = Sizes(users=spec.users, user_tokens=spec.prompt_tokens_after(spec.rounds),
                  kv_bytes_per_token=kv_bytes_per_token(model, args.dtype),
                  fraction=args.kv_fraction, max_model_len=BLOCK * math.ceil(longest / BLOCK + 1))
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-routing-", dir=Path.home()))
    servers = Servers(model, args.dtype, sizes, work, spec.users + 2)
    bench = Bench(argparse.Namespace(), spec, servers, tok, lines, questions)
    out: dict[str, Any] = {"policies": {}, "errors": {}}
    redis = faults.RedisHolder(RedisServer().start())
    try:
        for name in args.policies:
            try:
                run_policy(bench, redis, name, args, out)
            except Exception as e:  # noqa: BLE001 -- the run goes on; the JSON says it
                log.exception("policy %s failed", name)
                out["errors"][name] = f"{type(e).__name__}: {e}"
            write_json(args.json, {**out, "complete": False})
    finally:
        redis.stop()
    if not args.skip_sim:
        costs = costs_of(out["policies"]) if out["policies"] else sim.Costs()
        log.info("simulating with %s", costs)
        out["simulation"] = sim.simulate(costs)
        out["simulation_hot_tenant"] = sim.simulate(costs, replicas=(32,), hot_share=0.5)
        out["simulation_assumptions"] = sim.assumptions(costs)
    out["goals"] = goals(out)
    out.update(machine=machine(), load_average={"before": load0, "after": load_average()},
               model="SmolLM2-135M-Instruct", dtype=args.dtype, quick=args.quick,
               workload={**dataclasses.asdict(spec), "kill_rounds": args.kill_rounds},
               sizes=sizes.as_dict(), router_flags=ROUTER_FLAGS,
               wall_s=round(time.monotonic() - t0, 1), code=code_state(), work_dir=str(work),
               complete=True)
    write_json(args.json, out)
    print(render(out))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
