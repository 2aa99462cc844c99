"""The AFD plan search (pure Python, no processes): against MegaScale-Infer's worked numbers
and choices, against a brute-force search of a small space, and the plan written for this
machine runs as planned (the topology carries the batch)."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from tessera.cli import build_parser
from tessera.config import EngineConfig
from tessera.deploy.topology import Topology
from tessera.disagg import planner
from tessera.disagg.plan_cli import main as plan_main
from tessera.disagg.profile import build_profile
from tessera.machine_profiles import recorded_machine
from tessera.entrypoints.flags import from_args

MIXTRAL = planner.MODELS["mixtral-8x22b"]
A100 = planner.Gpu("A100", 2.0, 80, 2000, 312)   # the paper's roofline example: 312 TFLOPS, 2 TB/s


def test_expert_gemm_roofline_matches_the_papers_a100_example():
    """MegaScale-Infer §2.3: on an A100 a GEMM needs about F / B = 156 tokens to be compute
    bound; Mixtral-8x22B (top-2 of 8) at batch 156 gives each expert 39 tokens, 25 % MFU."""
    def mfu(b):
        flops = 2 * b * 3 * MIXTRAL.hidden * MIXTRAL.inter
        return flops / (A100.tflops * 1e12) / planner.expert_time(MIXTRAL, A100, 1, b)
    tokens_per_expert = 156 * MIXTRAL.top_k / MIXTRAL.experts
    assert tokens_per_expert == 39
    assert mfu(39) == pytest.approx(0.25, rel=0.01)
    assert mfu(156) == pytest.approx(1.0, rel=0.01) and mfu(400) == pytest.approx(1.0)


def test_dispatch_bytes_match_the_papers_message_size():
    """MegaScale-Infer §5: Mixtral-8x22B, micro-batch 128, TP 2 -> 196,608 bytes per
    attention-to-expert connection (one of E = 8)."""
    assert planner.a2e_bytes(MIXTRAL, 128, 2) / MIXTRAL.experts == 196_608


def test_search_never_picks_fewer_than_three_micro_batches():
    """Eq. 3 (m T_f >= 2 (T_f + T_c)) rules out m <= 2 whenever communication takes any time,
    so even a search allowed m = 1 and 2 lands on m >= 3 (the paper searches from 3)."""
    plan = planner.search(MIXTRAL, ["H20"], ["L40S"], slo_s=0.150, min_m=1)
    assert plan is not None and plan.m >= 3 and plan.t_c > 0


def test_heterogeneous_search_picks_the_papers_pairing():
    """MegaScale-Infer §4.3: memory-bandwidth-rich H20 for attention, FLOP-cheap L40S for the
    experts, and better throughput per cost than any single GPU type."""
    names = list(planner.GPUS)
    for shape in (MIXTRAL, planner.MODELS["dbrx"]):
        best = planner.search(shape, names, names, slo_s=0.150)
        assert (best.attention_gpu, best.expert_gpu) == ("H20", "L40S")
        assert best.tpuc > max(planner.search(shape, [g], [g], slo_s=0.150).tpuc for g in names)


SMALL = planner.MoeShape("small", layers=8, hidden=2048, inter=4096, experts=8, top_k=2, gqa=4, seq_len=256)


def brute_force(shape, ga, ge, slo_s, tps, ms, max_batch):
    plans = (planner.evaluate(shape, planner.GPUS[ga], planner.GPUS[ge], tp_a, tp_e, m, b, slo_s)
             for tp_a, tp_e, m in itertools.product(tps, tps, ms) for b in range(1, max_batch + 1))
    return max((p for p in plans if p), key=lambda p: p.tpuc, default=None)


@pytest.mark.parametrize("shape,ga,ge,slo_s", [
    (SMALL, "A800", "H800", 0.002),       # a constraint other than the SLO stops B below 1024
    (MIXTRAL, "H20", "L40S", 0.050),      # the SLO stops B below 1024
    (MIXTRAL, "L20", "L20", 0.150),       # B reaches the space's edge
    (SMALL, "H20", "L40S", 0.0005)])      # nothing meets the SLO
def test_algorithm1_finds_what_a_brute_force_search_finds(shape, ga, ge, slo_s):
    """Binary search for the largest B and the loops over (tp_a, tp_e, m) against every point
    of a small space (B <= 1024, tp <= 2, m <= 4)."""
    found = planner.search(shape, [ga], [ge], slo_s, tps=(1, 2), min_m=1, max_batch=1024)
    expected = brute_force(shape, ga, ge, slo_s, (1, 2), range(1, 5), 1024)
    if expected is None:
        assert found is None
    else:
        assert (found.tp_a, found.tp_e, found.m, found.batch) == \
            (expected.tp_a, expected.tp_e, expected.m, expected.batch)
        assert found.tpuc == pytest.approx(expected.tpuc) and found.t_total <= slo_s


def test_no_plan_meets_an_impossible_slo():
    assert planner.search(MIXTRAL, ["H20"], ["L40S"], slo_s=1e-4) is None


def _plan_here(tmp_path, rows, **kw):
    profile, out = tmp_path / "p.json", tmp_path / "plan.yaml"
    profile.write_text(json.dumps(dict(build_profile(rows, layers=4), machine=recorded_machine())))   # taken here
    args = dict(profile=str(profile), slo_ms=150.0, serve_model="random:mixtral", out=str(out), context_len=1024)
    plan_main(SimpleNamespace(**{**args, **kw}))
    return Topology.load(out)


def test_plan_here_is_runnable_as_planned(tmp_path):
    """The attention node the topology starts runs the planned batch B: B running requests, a
    step budget for B decode tokens, KV blocks for B requests of --context-len tokens."""
    rows = [{"batch": b, "t_a_ms": 0.05 * b, "t_e_ms": 0.05 * b, "t_c_ms": 0.2, "t_o_ms": 1.0} for b in (8, 64, 256)]
    topology = _plan_here(tmp_path, rows, context_len=300)
    attention = topology.roles["attention_node"].options
    assert attention["micro_batches"] >= 2   # T_e grows with tokens: the overlap pays
    batch = attention["max_num_seqs"]
    (proc,) = [p for p in topology.processes() if p.role == "attention_node"]
    config = from_args(EngineConfig, build_parser({"attention-node"}).parse_args(list(proc.argv)))
    assert config.scheduler.max_num_seqs == batch and config.scheduler.max_num_batched_tokens >= batch
    assert config.cache.num_blocks * config.cache.block_size >= batch * 300


def test_plan_here_balances_attention_nodes_against_the_expert(tmp_path):
    """k1 / k3 = 3: attention is three times as costly per token as the expert, so three
    attention nodes share one expert node (BALANCE)."""
    rows = [{"batch": b, "t_a_ms": 0.03 * b, "t_e_ms": 0.01 * b, "t_c_ms": 0.05, "t_o_ms": 0.5} for b in (8, 64, 256)]
    topology = _plan_here(tmp_path, rows)
    assert topology.roles["attention_node"].replicas == 3 and topology.roles["expert_node"].replicas == 1
