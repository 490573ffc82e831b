"""bench/ttft.py's arithmetic and text: a restore's breakdown, throughput, the goals, tables."""

from __future__ import annotations

from typing import Any

# A restore's breakdown (seconds; the decoding stages summed over the decoding threads).
BREAKDOWN = ("scheduler_lookup_s", "worker_lookup_s", "read_s", "decompress_s", "transform_s",
             "copy_s", "load_wall_s", "vllm_s", "loaded_bytes", "minor_faults", "major_faults")
RESTORES = ("restore_cpu_s", "restore_disk_s", "restore_disk_warm_s", "restore_redis_s")
SHOWN = ("prefix_cache_s", *RESTORES, "lmcache_s")
LABELS = {"prefix_cache_s": "floor", "restore_cpu_s": "cpu", "restore_disk_s": "disk",
          "restore_disk_warm_s": "disk-warm", "restore_redis_s": "redis",
          "lmcache_s": "lmcache"}


def breakdown_of(d: dict[str, float], ttft: float) -> dict[str, float]:
    """One restore's breakdown from the growth of the connector's counters (``d``)."""
    def summed(prefix: str) -> float:
        return sum(v for k, v in d.items() if k.startswith(prefix + "|"))

    def phase(p: str) -> float:
        return d.get(f"cwm:connector_load_phase_seconds|{p}", 0.0)

    # the request waits for its lookup in the background (lookup_store) plus the step's share
    lookup = d.get("cwm:connector_lookup_store_seconds", 0.0) + \
        d.get("cwm:connector_lookup_seconds", 0.0)
    wall = summed("cwm:connector_load_seconds")
    return {"scheduler_lookup_s": lookup, "worker_lookup_s": phase("lookup"),
            "read_s": phase("read"), "decompress_s": phase("decompress"),
            "transform_s": phase("transform"), "copy_s": phase("copy"), "load_wall_s": wall,
            "vllm_s": ttft - lookup - wall, "loaded_bytes": summed("cwm:connector_loaded_bytes")}


def throughput(r: dict[str, Any], speeds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per restore column: raw KV GB/s over the load's wall time and over the time above the
    floor, and the first as a fraction of this machine's memory copy and cached read."""
    out: dict[str, dict[str, float]] = {}
    floor = r.get("prefix_cache_s")
    for col in RESTORES:
        b = r["breakdown"].get(col[:-2])
        if not b or not b["load_wall_s"]:
            continue
        gbps = b["loaded_bytes"] / b["load_wall_s"] / 1e9
        above = r[col] - floor if floor and r.get(col) else None
        out[col[:-2]] = {
            "load_gbps": gbps,
            "above_floor_gbps": b["loaded_bytes"] / above / 1e9 if above and above > 0 else None,
            "of_memcpy": gbps / speeds["memcpy_gbps"],
            "of_cached_read": gbps / speeds["cached_read_gbps"]}
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def goals(results: dict[int, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """The issue's goals, evaluated on what was measured (None where a column is missing)."""
    top_n = max(lengths)
    top = results[top_n]
    floor = top.get("prefix_cache_s")
    cpu, disk, redis = (_ratio(top.get(k), floor) for k in
                        ("restore_cpu_s", "restore_disk_s", "restore_redis_s"))
    # linear in length: the restore's own time (the connector's load wall, measured inside
    # the worker) per token, largest over smallest. The time above the floor says the same
    # where it is large, but at 1k the floor's own noise (+-50 ms) exceeds the restore (~25 ms)
    per_token = {str(n): results[n]["breakdown"]["restore_cpu"]["load_wall_s"]
                 / results[n]["tokens"] for n in lengths
                 if results[n].get("breakdown", {}).get("restore_cpu", {}).get("load_wall_s")}
    above = {str(n): (results[n]["restore_cpu_s"] - results[n]["prefix_cache_s"])
             / results[n]["tokens"] for n in lengths
             if results[n].get("restore_cpu_s") and results[n].get("prefix_cache_s")}
    spread = (max(per_token.values()) / min(per_token.values())
              if len(per_token) > 1 and min(per_token.values()) > 0 else None)
    out: dict[str, Any] = {
        "at_tokens": top.get("tokens"),
        "cpu_vs_floor": cpu, "cpu_at_most_2x_floor": None if cpu is None else cpu <= 2,
        "cpu_load_s_per_token": per_token, "cpu_above_floor_s_per_token": above,
        "cpu_per_token_spread": spread,
        "cpu_linear": None if spread is None else spread <= 1.5,
        "disk_cold_vs_floor": disk,
        "disk_cold_at_most_3x_floor": None if disk is None else disk <= 3,
        "redis_vs_floor": redis, "redis_at_most_3x_floor": None if redis is None else redis <= 3,
        "per_length": {}}
    for n in lengths:
        r = results[n]
        p: dict[str, Any] = {}
        for col in ("restore_cpu_s", "restore_disk_s", "restore_redis_s"):
            v = _ratio(r.get(col), r.get("lmcache_s"))
            p[f"{col[8:-2]}_vs_lmcache"] = v
            p[f"{col[8:-2]}_at_most_0.2x_lmcache"] = None if v is None else v <= 0.2
        b = _ratio(r.get("bytes_per_token"), r.get("lmcache_bytes_per_token"))
        p.update(bytes_vs_lmcache=b, **{"bytes_at_most_0.66x": None if b is None else b <= 0.66})
        out["per_length"][str(n)] = p
    return out


def table(results: dict[int, dict[str, Any]], lengths: list[int], g: dict[str, Any],
          speeds: dict[str, float]) -> str:
    def cell(r: dict[str, Any], k: str) -> str:
        t, floor = r.get(k), r.get("prefix_cache_s")
        if not t:
            return "n/a"
        return f"{t:.3f}" if k == "prefix_cache_s" or not floor else f"{t:.3f} {t / floor:4.1f}x"

    head = f"{'tokens':>7} {'recompute':>9} " + " ".join(f"{LABELS[k]:>12}" for k in SHOWN)
    lines = [head + f" {'B/tok':>6} {'LMC B/tok':>9}"]
    for n in lengths:
        r = results[n]
        cells = " ".join(f"{cell(r, k):>12}" for k in SHOWN)
        lines.append(f"{r['tokens']:>7} {r['recompute_s']:>9.2f} {cells} "
                     f"{r.get('bytes_per_token') or 0:>6.0f} "
                     f"{r.get('lmcache_bytes_per_token') or 0:>9.0f}")
    lines.append("\nwhere a restore's time goes (median ms; decompress/transform/copy summed over "
                 "the decoding threads; vLLM = the rest of the time to first token)")
    cols = ("sched lookup", "lookup", "read", "decompress", "transform", "copy", "load wall",
            "vLLM", "GB/s", "of memcpy", "of read", "page faults")
    lines.append(f"{'tokens':>7} {'restore':>9} " + " ".join(f"{c:>12}" for c in cols))
    for n in lengths:
        r = results[n]
        for col, b in r["breakdown"].items():
            tp = r.get("throughput", {}).get(col, {})
            ms = " ".join(f"{b[k] * 1e3:>12.1f}" for k in BREAKDOWN if k.endswith("_s"))
            lines.append(f"{r['tokens']:>7} {LABELS[col + '_s']:>9} {ms} "
                         f"{tp.get('load_gbps', 0):>12.2f} {_pct(tp.get('of_memcpy')):>12} "
                         f"{_pct(tp.get('of_cached_read')):>12} "
                         f"{b.get('minor_faults', 0) + b.get('major_faults', 0):>12.0f}")
    lines.append(f"this machine, same run: memory copy {speeds['memcpy_gbps']:.1f} GB/s, cached "
                 f"file read {speeds['cached_read_gbps']:.1f} GB/s (one thread)")
    at = g["at_tokens"]
    lines.append(f"goal CPU-tier restore <= 2x the floor at {at} tokens: "
                 f"{_x(g['cpu_vs_floor'])} -> {_verdict(g['cpu_at_most_2x_floor'])}; linear "
                 f"in length (the connector's load time per token, largest/smallest "
                 f"{_x(g['cpu_per_token_spread'])} <= 1.5x) -> {_verdict(g['cpu_linear'])}")
    lines.append(f"goal cold-disk restore <= 3x the floor: {_x(g['disk_cold_vs_floor'])} -> "
                 f"{_verdict(g['disk_cold_at_most_3x_floor'])}; Redis <= 3x: "
                 f"{_x(g['redis_vs_floor'])} -> {_verdict(g['redis_at_most_3x_floor'])}")
    for n in lengths:
        p = g["per_length"][str(n)]
        lines.append(f"goal at {n}: <= 0.2x LMCache's time: cpu {_x(p['cpu_vs_lmcache'])}, "
                     f"disk {_x(p['disk_vs_lmcache'])}, redis {_x(p['redis_vs_lmcache'])} -> "
                     f"{_verdict(p['disk_at_most_0.2x_lmcache'])} (disk); bytes <= 0.66x "
                     f"LMCache's: {_x(p['bytes_vs_lmcache'])} -> "
                     f"{_verdict(p['bytes_at_most_0.66x'])}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "n/a"


def _x(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")
