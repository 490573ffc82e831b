"""bench/serving.py's command line: the parts of a run, the workload's sizes (a full run's
and ``--quick``'s) and the knobs of the servers and the faults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _serving_configs import CONFIGS

from cwm_plugin.compute_dtype import compute_dtype

FULL = {"users": 8, "rounds": 6, "answer_tokens": 16, "context_tokens": 1200, "qps": 0.6,
        "sweep_users": [4, 16], "sweep_configs": ["vllm", "lmcache", "cwm_cpu"],
        "fault_rounds": 2, "greedy_sessions": 3, "saturated_rounds": 6}
QUICK = {"users": 4, "rounds": 3, "answer_tokens": 16, "context_tokens": 600, "qps": 0.6,
         "sweep_users": [2, 6], "sweep_configs": ["vllm", "cwm_cpu"], "fault_rounds": 2,
         "greedy_sessions": 2, "saturated_rounds": 2}
PARTS = ("sweep", "fits", "greedy", "faults", "tiny_budgets", "sidecar", "cluster")


def parse(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The run's arguments, each size left unset taken from ``--quick``'s or the full run's."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", type=Path, default=Path("bench/results/serving.json"))
    ap.add_argument("--quick", action="store_true", help="a few minutes' run of every part")
    ap.add_argument("--configs", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--skip", nargs="*", choices=PARTS, default=[])
    for k, v in FULL.items():
        kind = type(v[0]) if isinstance(v, list) else type(v)
        ap.add_argument(f"--{k.replace('_', '-')}", type=kind, nargs="*" if isinstance(v, list)
                        else None, help=f"full: {v}; --quick: {QUICK[k]}")
    ap.add_argument("--system-tokens", type=int, default=150)
    ap.add_argument("--think-s", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-fraction", type=float, default=0.33,
                    help="of the users' KV that vLLM's own cache holds")
    ap.add_argument("--slo-x", type=float, default=4.0, help="TTFT objective: x the floor")
    ap.add_argument("--repeat", type=int, default=1,
                    help="main and saturated phases a config (medians)")
    ap.add_argument("--fault-at", type=float, default=0.3, help="of the baseline round's time")
    ap.add_argument("--blackhole-s", type=float, default=10.0)
    ap.add_argument("--redis-down-s", type=float, default=2.0)
    ap.add_argument("--gc-every-s", type=float, default=5.0,
                    help="store_gc round: a gc pass starts this often (one cwm store gc --every)")
    ap.add_argument("--dtype", default="auto", help="auto (this CPU's: cwm_plugin.compute_dtype), "
                    "bfloat16, float32 or float16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=128,
                    help="vLLM's token budget a step, every config alike: a cold prefill is "
                         "chunked so that decoding requests keep getting tokens while it runs "
                         "(vLLM's CPU default, 2048, stalls them for a whole prefill)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0,
                    help="vLLM's cap on one request's prefill tokens a step, every config alike "
                         "(0: vLLM's default, none): a running cold prefill then leaves part of "
                         "the budget to requests that arrive behind it")
    ap.add_argument("--store", type=json.loads, default={}, metavar="JSON",
                    help='store settings over our configs\' own, e.g. \'{"zstd_level": 0}\'')
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.parts = [p for p in PARTS if p not in args.skip]
    args.dtype = compute_dtype(args.dtype)
    return args
