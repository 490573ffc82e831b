"""bench/serving.py's Redis Cluster run: the shipped Redis config against a real 3-master
cluster (cwm_plugin/testing/redis_cluster.py), the main workload's rounds, and how the commands
spread over the masters (their ``total_commands_processed`` and ``commandstats``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _serving_configs import connector_args, shipped_redis
from _serving_faults import Player

from cwm_plugin.testing.redis_cluster import RedisCluster


def commands_per_node(ports: Sequence[int]) -> dict[int, int]:
    """``total_commands_processed`` of each Redis node (the INFO call itself included)."""
    import redis

    out = {}
    for p in ports:
        c = redis.Redis(host="127.0.0.1", port=p, socket_timeout=5)
        try:
            out[p] = int(c.info("stats")["total_commands_processed"])
        finally:
            c.close()
    return out


def command_stats(ports: Sequence[int]) -> dict[int, dict[str, int]]:
    """Calls per command of each node (INFO commandstats)."""
    import redis

    out: dict[int, dict[str, int]] = {}
    for p in ports:
        c = redis.Redis(host="127.0.0.1", port=p, socket_timeout=5)
        try:
            out[p] = {k.removeprefix("cmdstat_"): int(v["calls"])
                      for k, v in c.info("commandstats").items()}
        finally:
            c.close()
    return out


def shares(before: dict[int, int], after: dict[int, int]) -> dict[str, Any]:
    grown = {p: after[p] - before[p] - 1 for p in after}   # less our own INFO
    total = sum(grown.values()) or 1
    return {"commands": {str(p): n for p, n in grown.items()},
            "share": {str(p): round(n / total, 3) for p, n in grown.items()},
            "max_share": round(max(grown.values()) / total, 3) if grown else None}


def run(bench: Player) -> None:
    """The main workload on the shipped Redis config over a real 3-master cluster: each
    master's share of the commands (``bench.out["redis_cluster"]``)."""
    with RedisCluster() as cl:
        ports = [n.port for n in cl.nodes]
        extra = shipped_redis(cl.url, bench.servers.work / "cluster-disk",
                              redis_cluster=True)
        with bench.servers.vllm(connector_args(extra)) as server:
            bench.warm(server.base_url, "cluster")
            before, stats0 = commands_per_node(ports), command_stats(ports)
            got = bench.phase(server, bench.sessions("cluster"), bench.spec.rounds,
                              "cluster")
            after, stats1 = commands_per_node(ports), command_stats(ports)
        bench.out["redis_cluster"] = {
            **got, **shares(before, after),
            "commandstats": {str(p): {k: v - stats0[p].get(k, 0) for k, v in s.items()
                                      if v - stats0[p].get(k, 0)}
                             for p, s in stats1.items()}}
