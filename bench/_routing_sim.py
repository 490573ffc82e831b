"""bench/routing.py's simulator: the routing policies replayed over many replicas and thousands
of users, with costs measured by the real run (:class:`Costs`).

Assumptions (stated in the JSON as well):

* Each user is one session (its own ``cache_salt``: no two sessions share a KV block) whose
  prompt grows by ``round_tokens`` a round from ``first_tokens``; a round's possible hit is its
  previous round's prompt in whole blocks.
* Requests arrive as one open stream at ``load`` of the replicas' capacity; each names a user,
  half of them (``hot_share``) from a hot tenant whose sessions share a ``hot_prefix_tokens``
  system prompt (one prefix to a text-matching router), the rest uniformly.
* A replica serves one request at a time, FIFO (a 2-core vLLM is close to that); a request
  costs ``base_s`` + its computed tokens x ``prefill_s_per_token`` + its restored tokens x
  ``restore_s_per_token`` (local tier) or ``shared_s_per_token`` (the shared Redis tier).
* Each replica keeps ``local_blocks`` blocks (vLLM's cache and our CPU tier, LRU); every block
  computed anywhere is also in the shared tier, restorable on every replica.
* Loads are outstanding requests (queued or running) when a request arrives.

Policies: ``round_robin``; ``consistent_hash`` (rendezvous on the session key: pure affinity);
``cache_aware`` (sglang/vllm-router's text tree: the replica whose text matches most of the
prompt when the match is over half of it and the loads are balanced, else the least loaded;
a session's earlier prompts and the hot prefix are what match); ``kv_aware`` as vllm-router
0.1.17 treats a salted request (no prefix credit: the least loaded); ``kv_aware_tiers`` as it
would with the salt in its block hash (the upstream fix, docs/router.md): among the replicas
whose load is under ``bound`` x the mean (rounded up), the one holding most of the session's
blocks in its own tiers, the session's rendezvous order breaking ties (bounded-load affinity: a
busy replica's sessions spill to the next, restoring from the shared tier, and their KV is then
found there).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

POLICIES = ("round_robin", "consistent_hash", "cache_aware", "kv_aware", "kv_aware_tiers")
BLOCK = 128


@dataclass(frozen=True)
class Costs:
    """Seconds, measured by the real run (defaults: SmolLM2-135M bf16, 2 cores)."""

    base_s: float = 0.08
    prefill_s_per_token: float = 2.0e-4
    restore_s_per_token: float = 1.2e-5
    shared_s_per_token: float = 4.0e-5


@dataclass(frozen=True)
class SimSpec:
    replicas: int = 8
    users: int = 2000
    requests: int = 20000
    first_tokens: int = 1000
    round_tokens: int = 120
    max_tokens: int = 6000
    local_blocks: int = 4000
    hot_share: float = 0.0
    hot_users: int = 0          # 0: users // 10
    hot_prefix_tokens: int = 768
    load: float = 0.7           # of the replicas' capacity
    bound: float = 2.0          # kv_aware_tiers: no replica above bound x the mean load
    seed: int = 0


@dataclass
class Replica:
    blocks: OrderedDict = field(default_factory=OrderedDict)    # (user, i) -> None, LRU
    busy_until: float = 0.0
    ends: list[float] = field(default_factory=list)             # outstanding requests' ends
    served: int = 0
    sessions: set = field(default_factory=set)                  # text a tree would match

    def load(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        return len(self.ends)

    def held(self, user: int, n: int) -> int:
        """Leading blocks of ``user``'s prompt held here (of ``n``)."""
        k = 0
        while k < n and (user, k) in self.blocks:
            k += 1
        return k


def _rank(user: int, replicas: int) -> list[int]:
    """Rendezvous order of the replicas for a session."""
    def score(r: int) -> bytes:
        return hashlib.blake2b(f"{user}:{r}".encode(), digest_size=8).digest()
    return sorted(range(replicas), key=score, reverse=True)


class Simulation:
    def __init__(self, spec: SimSpec, costs: Costs) -> None:
        self.spec, self.costs = spec, costs
        self.reps = [Replica() for _ in range(spec.replicas)]
        self.rounds: dict[int, int] = {}
        self.rr = 0
        self.hot = spec.hot_users or max(1, spec.users // 10)

    def prompt_blocks(self, rnd: int) -> int:
        s = self.spec
        return min(s.first_tokens + rnd * s.round_tokens, s.max_tokens) // BLOCK

    def cost(self, rep: Replica, user: int, n: int, prev: int, now: float) -> float:
        """Seconds until the request's first token there: queued, then served."""
        return max(0.0, rep.busy_until - now) + self.service(rep, user, n, prev)

    def service(self, rep: Replica, user: int, n: int, prev: int) -> float:
        local = min(rep.held(user, n), prev)
        c = self.costs
        return (c.base_s + (prev - local) * BLOCK * c.shared_s_per_token
                + local * BLOCK * c.restore_s_per_token
                + (n - prev) * BLOCK * c.prefill_s_per_token)

    def choose(self, policy: str, user: int, n: int, prev: int, now: float) -> int:
        reps, R = self.reps, len(self.reps)
        loads = [r.load(now) for r in reps]
        if policy == "round_robin":
            self.rr += 1
            return self.rr % R
        if policy == "consistent_hash":
            return _rank(user, R)[0]
        least = min(range(R), key=lambda i: (loads[i], reps[i].served))
        if policy == "kv_aware":
            return least
        if policy == "cache_aware":
            if max(loads) - min(loads) > 32 and max(loads) > 1.5 * min(loads):
                return least
            hot = user < self.hot and self.spec.hot_share > 0
            total = n * BLOCK
            best, match = 0, -1
            for i, r in enumerate(reps):
                m = prev * BLOCK if user in r.sessions else \
                    (self.spec.hot_prefix_tokens if hot and "hot" in r.sessions else 0)
                if m > match:
                    best, match = i, m
            if match > total / 2:
                return best
            return min(range(R), key=lambda i: (len(reps[i].sessions), i))
        if policy == "kv_aware_tiers":
            cap = math.ceil(self.spec.bound * (sum(loads) + 1) / R)
            ok = [i for i in _rank(user, R) if loads[i] < cap] or [least]
            # the most blocks held there (a block in the shared tier counts alike everywhere),
            # the session's own replica first among equals
            return max(ok, key=lambda i: (min(reps[i].held(user, n), prev), -ok.index(i)))
        raise ValueError(policy)

    def run(self, policy: str) -> dict[str, Any]:
        s, c = self.spec, self.costs
        rng = random.Random(s.seed)
        mean_cost = c.base_s + s.first_tokens * c.prefill_s_per_token / 4
        rate = s.load * s.replicas / mean_cost
        now, possible, local_hit, shared_hit = 0.0, 0, 0, 0
        for _ in range(s.requests):
            now += rng.expovariate(rate)
            if s.hot_share and rng.random() < s.hot_share:
                user = rng.randrange(self.hot)
            else:
                user = rng.randrange(self.hot if s.hot_share else 0, s.users)
            rnd = self.rounds.get(user, -1) + 1
            self.rounds[user] = rnd
            n = self.prompt_blocks(rnd)
            prev = self.prompt_blocks(rnd - 1) if rnd else 0
            i = self.choose(policy, user, n, prev, now)
            rep = self.reps[i]
            local = min(rep.held(user, n), prev)
            possible += prev
            local_hit += local
            shared_hit += prev - local
            end = max(now, rep.busy_until) + self.service(rep, user, n, prev)
            rep.busy_until = end
            heapq.heappush(rep.ends, end)
            rep.served += 1
            rep.sessions.add(user)
            if user < self.hot and s.hot_share:
                rep.sessions.add("hot")
            for k in range(n):
                rep.blocks[(user, k)] = None
                rep.blocks.move_to_end((user, k))
            while len(rep.blocks) > s.local_blocks:
                rep.blocks.popitem(last=False)
        served = [r.served for r in self.reps]
        mean = sum(served) / len(served)
        return {"hit_fraction": round((local_hit + shared_hit) / max(1, possible), 4),
                "local_hit_fraction": round(local_hit / max(1, possible), 4),
                "max_over_mean": round(max(served) / mean, 3)}


def simulate(costs: Costs, replicas: tuple[int, ...] = (8, 32, 128), users_per_replica: int = 60,
             requests_per_replica: int = 600, hot_share: float = 0.0, seed: int = 0,
             policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Every policy at each replica count: ``{"8": {policy: figures}, ...}``."""
    out: dict[str, Any] = {}
    for R in replicas:
        spec = SimSpec(replicas=R, users=users_per_replica * R,
                       requests=requests_per_replica * R, hot_share=hot_share, seed=seed)
        out[str(R)] = {p: Simulation(spec, costs).run(p) for p in policies}
    return out


def assumptions(costs: Costs) -> dict[str, Any]:
    return {"costs": asdict(costs), "spec": asdict(SimSpec()),
            "text": __doc__.split("Assumptions (stated in the JSON as well):", 1)[1]
            .split("Policies:", 1)[0].strip()}
