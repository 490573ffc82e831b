"""bench/routing.py's pieces without vLLM: what a returning round could hit, and the
simulator's policies on small clusters -- affinity keeps a session's blocks where it was,
round robin does not, bounded-load affinity caps the hottest replica where pure affinity
cannot, and a hot tenant's shared text draws a text-matching router to one replica. Structure
only: nothing here asserts a speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def sim(bench_module):
    return bench_module("_routing_sim")


def _req(user: str, rnd: int, sent: float, prompt: int, ok: bool = True):
    return SimpleNamespace(user=user, round=rnd, sent=sent, prompt_tokens=prompt,
                           ok=ok, returning=rnd > 0)


def test_possible_hits_are_the_previous_round_in_whole_blocks(bench_module):
    routing = bench_module("routing")
    reqs = [_req("a", 0, 0.0, 300), _req("b", 0, 0.1, 1000), _req("a", 1, 1.0, 340),
            _req("b", 1, 1.1, 1040, ok=False), _req("b", 2, 2.0, 1080)]
    # a: 300 + 16 - 1 = 315 tokens of KV -> 2 blocks (256); b's second round failed, so its
    # third has no previous round to count; b's first counts nothing
    assert routing.possible_tokens(reqs, 16) == 256
    # never past the blocks before the round's own last prompt token
    assert routing.possible_tokens([_req("a", 0, 0, 300), _req("a", 1, 1, 257)], 200) == 256


def test_affinity_keeps_sessions_local_and_round_robin_does_not(sim):
    spec = sim.SimSpec(replicas=4, users=200, requests=3000, seed=1)
    got = {p: sim.Simulation(spec, sim.Costs()).run(p) for p in sim.POLICIES}
    assert got["consistent_hash"]["local_hit_fraction"] == 1.0
    # round robin finds an older round of the session on a replica now and then, never all
    assert got["round_robin"]["local_hit_fraction"] < 0.9
    assert got["round_robin"]["max_over_mean"] == pytest.approx(1.0, abs=0.01)
    for p in sim.POLICIES:  # the shared tier holds every block: nothing is recomputed
        assert got[p]["hit_fraction"] == 1.0
    assert got["kv_aware_tiers"]["local_hit_fraction"] > got["kv_aware"]["local_hit_fraction"]


def test_bounded_load_caps_a_hot_tenant_that_pure_affinity_piles_up(sim):
    spec = sim.SimSpec(replicas=16, users=400, requests=8000, hot_share=0.5, hot_users=8,
                       seed=2)
    pure = sim.Simulation(spec, sim.Costs()).run("consistent_hash")
    bounded = sim.Simulation(spec, sim.Costs()).run("kv_aware_tiers")
    assert pure["max_over_mean"] > 1.8      # 8 hot sessions carry half the traffic
    assert bounded["max_over_mean"] < pure["max_over_mean"] - 0.4
    assert bounded["local_hit_fraction"] < pure["local_hit_fraction"]  # spills restore


def test_a_shared_prefix_draws_a_text_matching_router_to_one_replica(sim):
    spec = sim.SimSpec(replicas=4, users=100, requests=400, hot_share=1.0, hot_users=100,
                       first_tokens=900, hot_prefix_tokens=800, load=0.05, seed=3)
    got = sim.Simulation(spec, sim.Costs()).run("cache_aware")
    assert got["max_over_mean"] > 3.5       # (4.0: every request on one replica)


def test_simulate_names_every_policy_at_every_size(sim):
    out = sim.simulate(sim.Costs(), replicas=(2, 3), users_per_replica=5,
                       requests_per_replica=20)
    assert set(out) == {"2", "3"}
    assert all(set(v) == set(sim.POLICIES) for v in out.values())
    assert set(out["2"]["round_robin"]) == {"hit_fraction", "local_hit_fraction",
                                            "max_over_mean"}
    assert "shared tier" in sim.assumptions(sim.Costs())["text"]
