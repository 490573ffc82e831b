"""``cwm store usage|verify|gc``: inspect and maintain a store from the command line.

The store is opened with the settings of ``--config FILE.yaml`` (top-level store settings or a
``store:`` section) or of ``--disk-path``/``--redis-url``; the memory tier is off (a fresh CLI
process has nothing in memory). ``gc --every SECONDS`` stays running and collects that often
in one process (a systemd service beside vLLM): a process started for each run pays Python's
start and imports each time, more CPU than the collecting itself (bench/README.md,
``store_gc``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict

from cwm_plugin.errors import ConfigError, CWMError
from cwm_plugin.store.config import StoreConfig

log = logging.getLogger(__name__)
MAINTENANCE_NICE = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("store", help="inspect and maintain the KV block store")
    sub = group.add_subparsers(dest="store_command", required=True)
    for name, fn, help_ in (("usage", _usage, "bytes and blobs per tier"),
                            ("verify", _verify, "checksum every blob; quarantine bad ones"),
                            ("gc", _gc, "drop blobs no key points to, and orphan files")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", help="YAML file with the store settings")
        p.add_argument("--disk-path", help="root of the local disk tier")
        p.add_argument("--redis-url", help="Redis URL of the shared tier")
        p.add_argument("--redis-prefix", help="key prefix in Redis (default: cwm)")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.add_argument("--nice", type=int, default=None, metavar="N",
                       help="lower this process's CPU priority by N, run it in the SCHED_IDLE "
                            "class and at the lowest best-effort I/O priority (default "
                            f"{MAINTENANCE_NICE}; 0 keeps all three): maintenance yields the "
                            "cores to serving")
        if name == "verify":
            p.add_argument("--no-progress", action="store_true", help="no progress bar")
        if name == "gc":
            p.add_argument("--min-age", type=float, default=None, metavar="SECONDS",
                           help="only collect blobs older than this (default: the store's "
                                "gc_min_age_s, 600); blobs younger may be mid-save")
            p.add_argument("--every", type=_positive, default=None, metavar="SECONDS",
                           help="keep running: collect every SECONDS in this one process "
                                "until SIGTERM or Ctrl-C (one report a pass)")
        p.set_defaults(func=fn)


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    data: dict = {}
    if args.config:
        data = StoreConfig.from_file(args.config).to_dict()
    for field, value in (("disk_path", args.disk_path), ("redis_url", args.redis_url),
                         ("redis_prefix", getattr(args, "redis_prefix", None))):
        if value:
            data[field] = value
    if not data.get("disk_path") and not data.get("redis_url"):
        raise ConfigError("no store to open", hint="pass --config FILE.yaml or --disk-path P "
                                                   "and/or --redis-url U")
    data["memory_bytes"] = 0
    return StoreConfig.from_dict(data)


def yield_to_serving(nice: int) -> None:
    """Lower this process's CPU priority by ``nice``, put it in the ``SCHED_IDLE`` class (it
    runs only on cycles nothing else wants) and, where psutil can, its I/O priority to the
    lowest best-effort level. On a 2-core server a ``cwm store gc`` loop at normal priority
    takes a core from vLLM, and a nice value alone is not enough: vLLM's OpenMP threads wait
    for every thread of a step, so a niced process that preempts one of them for a few
    milliseconds stalls the whole step (bench/serving.py's ``store_gc`` round)."""
    if nice <= 0:
        return
    os.nice(nice)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            log.debug("scheduling class left as it is: %s", e)
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (ImportError, AttributeError, OSError) as e:  # not Linux, or no psutil
        log.debug("I/O priority left as it is: %s", e)


def _open(args: argparse.Namespace, *, decoding: bool = False):
    """The store's tiers (a :class:`~cwm_plugin.store.tier_set.TierSet`: gc and usage read
    no payload, so they go without torch), or with ``decoding`` the whole
    :class:`~cwm_plugin.store.kv_store.KVStore`; either at the maintenance priority."""
    config = config_from_args(args)
    yield_to_serving(MAINTENANCE_NICE if args.nice is None else args.nice)
    from prometheus_client import CollectorRegistry

    if decoding:
        from cwm_plugin.store.kv_store import KVStore

        return KVStore(config, registry=CollectorRegistry())
    from cwm_plugin.store.tier_set import TierSet

    return TierSet(config, registry=CollectorRegistry())


def _usage(args: argparse.Namespace) -> int:
    with _open(args) as store:
        usage = store.usage()
    if args.json:
        print(json.dumps(usage, indent=2))
        return 0
    print(f"{'tier':8s} {'blobs':>10s} {'bytes':>16s} {'budget':>16s} {'keys':>10s} "
          f"{'pinned bytes':>16s}")
    for tier, u in usage.items():
        budget = "-" if u["budget"] is None else f"{u['budget']:,}"
        keys = "-" if u.get("keys") is None else f"{u['keys']:,}"
        print(f"{tier:8s} {u['blobs']:>10,} {u['bytes']:>16,} {budget:>16s} {keys:>10s} "
              f"{u.get('pinned_bytes') or 0:>16,}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _open(args, decoding=True) as store:
        report = store.verify(progress=not args.no_progress)
    if args.json:
        print(json.dumps({**asdict(report), "clean": report.clean}, indent=2))
    else:
        print(f"checked {report.checked} blobs ({report.bytes_checked:,} bytes): "
              f"{report.ok} ok, {len(report.corrupt)} corrupt (quarantined), "
              f"{len(report.incompatible)} incompatible, {len(report.missing)} missing")
    if not report.clean:
        raise CorruptStoreFound(f"{len(report.corrupt)} corrupt and {len(report.missing)} "
                                "missing blobs", hint="corrupt ones were quarantined; "
                                "their blocks will be recomputed")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def _gc(args: argparse.Namespace) -> int:
    with _open(args) as store:
        if args.every is not None:
            return _gc_every(args, store)
        _print_gc(args, store.gc(args.min_age))
    return 0


def _gc_every(args: argparse.Namespace, store) -> int:
    """A pass every ``args.every`` seconds (start to start) until SIGTERM or SIGINT; a pass
    that fails (a tier down, a locked disk index) is logged and the next one runs."""
    from cwm_plugin.store.tiers.base import TIER_ERRORS

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("gc: a pass every %.1f s until SIGTERM or Ctrl-C", args.every)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            report = store.gc(args.min_age)
        except (*TIER_ERRORS, CWMError) as exc:
            log.warning("gc: this pass failed (%s); the next one runs in %.1f s", exc,
                        args.every)
        else:
            _print_gc(args, report, seconds=time.monotonic() - t0)
        stop.wait(max(0.0, args.every - (time.monotonic() - t0)))
    return 0


def _print_gc(args: argparse.Namespace, report, seconds: float | None = None) -> None:
    if args.json:
        out = asdict(report) if seconds is None else {**asdict(report),
                                                      "seconds": round(seconds, 3)}
        print(json.dumps(out, indent=None if seconds is not None else 2), flush=True)
        return
    removed = ", ".join(f"{t}: {n}" for t, n in report.removed_blobs.items()) or "none"
    print(f"removed blobs ({removed}), {report.orphan_files} orphan files, "
          f"{report.dangling_keys} dangling keys, {report.expired_entries} expired index "
          f"entries, {report.old_format_entries} old-format Redis names; freed "
          f"{report.freed_bytes:,} bytes", flush=True)


class CorruptStoreFound(CWMError):
    code = "store_corrupt"
