"""The LLM-PQ planner (pure Python + CBC): the ILP against a brute force over every contiguous
split and per-layer bit-width of small instances, the baselines against their definitions, the
plan validator against broken plans, the enumeration of device orders, and memory budgets."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import replace

import pytest

from tessera.pipeline import ilp
from tessera.pipeline.costmodel import MemoryModel, ModelShape, ProfiledLatency, Regression
from tessera.pipeline.devices import Cluster, Device
from tessera.pipeline.ilp import Assignment, Infeasible, Tables
from tessera.pipeline.plan import PlanError, validate
from tessera.pipeline.planner import (CostModel, Workload, candidates, plan_method, prefill_sizes, tables_for,
                                      type_orders, uniform_assignment)

BITS = (4, 8, 16)


def random_tables(seed: int, layers: int, devices: int, theta: float = 0.3, slack: float = 1.3,
                  speed: tuple[float, ...] | None = None) -> Tables:
    """Per device a speed, per bit a size and time; budgets between the 4-bit and 16-bit needs
    of an even split, so memory binds and the bit choice matters; sends that can outlast a
    short stage's compute."""
    rnd = random.Random(seed)
    size = {4: 1.0, 8: 1.9, 16: 3.7}
    speed = speed or [rnd.uniform(0.5, 2.0) for _ in range(devices)]
    even = math.ceil(layers / devices)
    budgets = tuple(rnd.uniform(size[4], size[16] / slack) * even * rnd.uniform(0.9, 1.4) for _ in range(devices))
    return Tables(
        bits=BITS, layer_bytes=tuple(size[b] for b in BITS), budgets=budgets,
        l_pre=tuple(tuple(s * (1.0 + 0.1 * (b == 4)) for b in BITS) for s in speed),      # prefill: bits barely matter
        l_dec=tuple(tuple(s * 0.02 * b / 16 * rnd.uniform(0.9, 1.1) for b in BITS) for s in speed),
        comm_pre=tuple(rnd.uniform(0, 3.0) for _ in range(devices)),
        comm_dec=tuple(rnd.uniform(0, 0.05) for _ in range(devices)),
        omega=tuple(tuple(rnd.uniform(0.5, 2.0) / (2 ** (b - 1) - 1) ** 2 * 40 for b in BITS) for _ in range(layers)),
        theta=theta, prefill_micro_batches=4, decode_micro_batches=devices, mu_n=20, pre0=0.2, dec0=0.003)


def splits(layers: int, devices: int):
    """Every contiguous layer -> device map with each device holding at least one layer."""
    for cuts in itertools.combinations(range(1, layers), devices - 1):
        bounds = (0, *cuts, layers)
        yield tuple(j for j in range(devices) for _ in range(bounds[j], bounds[j + 1]))


def reference_objective(t: Tables, device, bits, kind: str) -> float:
    """The objective of docs/design/pipeline.md#objective (or 'rounds'), written out again for
    the brute force."""
    n = t.devices
    pre = [t.pre0 if j == t.prepost_stage else 0.0 for j in range(n)]
    dec = [t.dec0 if j == t.prepost_stage else 0.0 for j in range(n)]
    for j, b in zip(device, bits):
        pre[j] += t.l_pre[j][BITS.index(b)]
        dec[j] += t.l_dec[j][BITS.index(b)]
    pre = [max(p, c) for p, c in zip(pre, t.comm_pre)]
    dec = [max(d, c) for d, c in zip(dec, t.comm_dec)]
    omega = sum(t.omega[i][BITS.index(b)] for i, b in enumerate(bits))
    total = sum(pre) + (t.prefill_micro_batches - 1) * max(pre) + t.theta * omega
    if kind == "paper":
        return total + sum(dec) + (t.decode_micro_batches - 1) * max(dec) * (t.mu_n - 1)
    if t.steps_overlap:       # micro-batches flow from step to step: the bottleneck stage runs all of them
        return total + (t.mu_n - 1) * max(sum(dec), t.decode_micro_batches * max(dec))
    # every step fills and drains: the first micro-batch crosses every stage, the rest follow the slowest
    return total + (t.mu_n - 1) * (sum(dec) + (t.decode_micro_batches - 1) * max(dec))


def fits(t: Tables, device, bits) -> bool:
    used = [0.0] * t.devices
    for j, b in zip(device, bits):
        used[j] += t.layer_bytes[BITS.index(b)]
    return all(u <= cap + 1e-9 for u, cap in zip(used, t.budgets))


def brute_force(t: Tables, key, allowed=BITS):
    """min key(device, bits) over every feasible assignment (None: nothing fits)."""
    best = None
    for device in splits(t.layers, t.devices):
        for bits in itertools.product(allowed, repeat=t.layers):
            if fits(t, device, bits):
                v = key(device, bits)
                best = v if best is None or v < best else best
    return best


@pytest.mark.parametrize("kind", ["paper", "rounds", "rounds, fill and drain"])
@pytest.mark.parametrize("seed,layers,devices,speed", [
    (0, 5, 2, None), (1, 6, 2, None), (2, 6, 2, None), (3, 4, 3, None), (4, 5, 3, None),
    (5, 5, 3, (1.0, 8.0, 1.0)),         # a slow middle device the optimum would rather skip
])
def test_ilp_optimum_equals_brute_force(seed, layers, devices, speed, kind):
    t = random_tables(seed, layers, devices, speed=speed)
    if kind == "rounds, fill and drain":        # Tessera's runner: the head on the last stage, no overlap
        t, kind = dataclasses.replace(t, prepost_stage=devices - 1, steps_overlap=False), "rounds"
    best = brute_force(t, lambda d, b: reference_objective(t, d, b, kind))
    assert best is not None, "test instance must be feasible"
    a = ilp.solve(t, kind, time_limit_s=30).assignment
    assert fits(t, a.device, a.bits)
    assert list(a.device) == sorted(a.device) and set(a.device) == set(range(devices))
    assert reference_objective(t, a.device, a.bits, kind) == pytest.approx(best, rel=1e-7)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_adabits_has_the_least_omega_that_fits(seed):
    t = random_tables(seed, 6, 2)
    best = brute_force(t, lambda d, b: sum(t.omega[i][BITS.index(x)] for i, x in enumerate(b)))
    a = ilp.solve_quality(t).assignment
    assert fits(t, a.device, a.bits)
    assert sum(t.omega[i][BITS.index(x)] for i, x in enumerate(a.bits)) == pytest.approx(best, rel=1e-9)


def test_pipeedge_minimizes_the_decode_bottleneck_at_the_highest_bit_that_fits():
    from tessera.pipeline.planner import pipeedge_assignment
    t = random_tables(8, 6, 2)
    top = next(b for b in sorted(BITS, reverse=True) if brute_force(t, lambda d, x: 0, allowed=(b,)) is not None)

    def bottleneck(device, bits):
        dec = [t.dec0 if j == 0 else 0.0 for j in range(t.devices)]
        for j, b in zip(device, bits):
            dec[j] += t.l_dec[j][BITS.index(b)]
        return max(max(d, c) for d, c in zip(dec, t.comm_dec))
    a = pipeedge_assignment(t, 30)
    assert set(a.bits) == {top} and top < 16        # the instance forces quantization
    assert bottleneck(a.device, a.bits) == pytest.approx(brute_force(t, bottleneck, allowed=(top,)))


def test_uniform_splits_evenly_at_the_highest_bit_that_fits():
    t = replace(random_tables(9, 5, 2), budgets=(3 * 1.9, 2 * 1.9 + 0.5))      # 8 bits fit 3 + 2 layers, 16 not
    a = uniform_assignment(t)
    assert a.device == (0, 0, 0, 1, 1) and a.bits == (8,) * 5
    with pytest.raises(Infeasible, match="uniform"):
        uniform_assignment(replace(t, budgets=(2.9, 2.0)))


def test_infeasible_budget_is_a_clear_error():
    t = replace(random_tables(0, 5, 2), budgets=(1.5, 1.5))                     # 5 layers need >= 5.0
    with pytest.raises(Infeasible, match="memory budgets"):
        ilp.solve(t)
    with pytest.raises(Infeasible, match="memory budgets"):
        ilp.solve_quality(t)


# ---------------------------------------------------------------------------------------------
# The planner on a small model with profiled (regression) devices

SHAPE = ModelShape("tiny", "llama", layers=8, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=1000)


def latency(speed: float) -> ProfiledLatency:
    """A device type with time = speed * (1e-6 b s + 1e-4) to prefill, speed * (2e-6 b + ...) to
    decode, bit-width making decode cheaper; pre/post speed * 5 ms per micro-batch."""
    box_lo, box_hi = (1, 1, 0), (64, 512, 512)
    fits_ = {b: (Regression("prefill", (0, 0, speed * 1e-6, 0, speed * 1e-4), box_lo, box_hi, 0.0),
                 Regression("decode", (speed * 1e-8, speed * 2e-6, 0, speed * b * 1e-5), box_lo, box_hi, 0.0))
             for b in BITS}
    pp = (Regression("prepost_prefill", (0, 0, speed * 5e-3), box_lo, box_hi, 0.0),
          Regression("prepost_decode", (0, speed * 5e-3), box_lo, box_hi, 0.0))
    return ProfiledLatency(fits_, pp)


def small_case(fast_mem=0.02, slow_mem=0.02, omega=None, runtime="tessera"):
    cluster = Cluster((Device("slow", "slow", slow_mem, profile="x"), Device("fast", "fast", fast_mem, profile="x")))
    om = omega or tuple(tuple(1 / (2 ** (b - 1) - 1) ** 2 * (1 + i % 3) for b in BITS) for i in range(SHAPE.layers))
    cost = CostModel("tiny", MemoryModel(SHAPE), {"slow": latency(4.0), "fast": latency(1.0)}, om, BITS, runtime)
    return cluster, cost, Workload(8, 64, 16, theta=0.01, time_limit_s=30)


@pytest.mark.parametrize("runtime,head", [("llm-pq", 0), ("tessera", -1)])
def test_enumeration_finds_the_better_device_order(runtime, head):
    """The slow device is listed first; the stage holding the head (stage 0 in LLM-PQ's runtime,
    the last in ours) carries the pre/post time, so the plan with the fast device there must
    win, and the planner must find it among the orders."""
    cluster, cost, work = small_case(runtime=runtime)
    assert [o[0].name for o in type_orders(cluster)] == ["slow", "fast"]
    per_order = {}
    for order in type_orders(cluster):
        objectives = []
        for xi in prefill_sizes(4):
            t = tables_for(cluster, cost, work, order, xi)
            objectives.append(ilp.evaluate(t, ilp.solve(t).assignment).objective)
        per_order[order[head].name] = min(objectives)
    plan = plan_method("llm-pq", cluster, cost, work)
    assert plan.order[head] == "fast" and per_order["fast"] < per_order["slow"]
    assert plan.objective == pytest.approx(per_order["fast"])


def test_candidates_follow_the_paper():
    assert prefill_sizes(8) == [2, 4, 8] and prefill_sizes(1) == [1] and prefill_sizes(7) == [7]
    cluster, _, _ = small_case()
    assert {xi for _, xi in candidates(cluster, 32)} == {2, 4, 8, 16}       # decode micro-batch 16
    assert len(candidates(cluster, 32)) == 2 * 4


def test_plans_are_valid_and_the_validator_catches_broken_ones():
    cluster, cost, work = small_case()
    devices = {d.name: d for d in cluster.devices}
    plans = {m: plan_method(m, cluster, cost, work) for m in ("llm-pq", "llm-pq (heuristic)", "pipeedge",
                                                             "uniform", "adabits")}
    for p in plans.values():
        validate(p, SHAPE.layers, cost.memory, devices, BITS)
        assert p.throughput_tok_s == pytest.approx(work.batch * work.gen_len / (p.prefill_s + p.decode_s))
    p = plans["llm-pq"]
    s0, s1 = p.stages
    broken = {
        "not contiguous": replace(p, stages=(replace(s0, end=s0.end - 1, bits=s0.bits[:-1]), s1)),
        "layer 0": replace(p, stages=(replace(s0, start=1, bits=s0.bits[1:]), s1)),
        "ends at": replace(p, stages=(s0, replace(s1, end=s1.end - 1, bits=s1.bits[:-1]))),
        "bit-widths": replace(p, stages=(replace(s0, bits=s0.bits[:-1] + (3,)), s1)),
        "two stages": replace(p, stages=(s0, replace(s1, device=s0.device))),
    }
    for match, bad in broken.items():
        with pytest.raises(PlanError, match=match):
            validate(bad, SHAPE.layers, cost.memory, devices, BITS)
    # the same stages on a device with a smaller memory than the plan uses
    small = {**devices, s1.device: replace(devices[s1.device], memory_gib=s1.memory_bytes / 2 ** 30 * 0.99)}
    with pytest.raises(PlanError, match="budget"):
        validate(p, SHAPE.layers, cost.memory, small, BITS)


def test_memory_budgets_shape_the_plan_and_impossible_ones_fail():
    tight, cost, work = small_case(fast_mem=0.004, slow_mem=0.004)
    roomy, _, _ = small_case(fast_mem=0.05, slow_mem=0.05)
    p_tight, p_roomy = (plan_method("adabits", c, cost, work) for c in (tight, roomy))
    assert min(p_tight.layer_bits) < 16 and set(p_roomy.layer_bits) == {16}
    for s in p_tight.stages:
        assert s.memory_bytes <= s.budget_bytes
    starved, _, _ = small_case(fast_mem=0.001, slow_mem=0.001)
    with pytest.raises(Infeasible, match="no device order"):
        plan_method("llm-pq", starved, cost, work)


def test_theta_trades_speed_for_quality():
    """A larger θ never raises Σω (and here lowers it) and never raises predicted speed."""
    cluster, cost, work = small_case(fast_mem=0.006, slow_mem=0.006)
    lo, hi = (plan_method("llm-pq", cluster, cost, replace(work, theta=th)) for th in (0.0, 100.0))
    assert hi.omega_sum < lo.omega_sum and hi.total_s >= lo.total_s


def test_omega_cap_holds_llm_pq_to_the_uniform_quality():
    cluster, cost, work = small_case(fast_mem=0.006, slow_mem=0.006)
    uniform = plan_method("uniform", cluster, cost, work)
    free = plan_method("llm-pq", cluster, cost, replace(work, theta=0.0))
    capped = plan_method("llm-pq", cluster, cost, replace(work, theta=0.0, omega_cap=uniform.omega_sum))
    assert free.omega_sum > uniform.omega_sum >= capped.omega_sum * (1 - 1e-9)
    assert capped.objective >= free.objective


def test_tables_put_embeddings_first_head_last_and_kv_for_the_whole_batch():
    cluster, cost, work = small_case()
    order = type_orders(cluster)[1]
    t = tables_for(cluster, cost, work, order, 2)
    mem = cost.memory
    kv = 8 * 2 * SHAPE.kv_heads * SHAPE.head_dim * (64 + 16) * 2          # B * 2 * kv * hd * (s + n) * 2 bytes
    assert t.layer_bytes[BITS.index(16)] == mem.weight_bytes(16) + kv
    first, last = order[0].budget_bytes() - t.budgets[0], order[1].budget_bytes() - t.budgets[1]
    assert first - last == pytest.approx(mem.extras_bytes(2, 4, True, False) - mem.extras_bytes(2, 4, False, True))
    # the runtime's last stage holds an LM head (pipeline/shard.py), the first the embeddings
    assert mem.extras_bytes(2, 4, False, True) >= 2 * SHAPE.vocab * SHAPE.hidden
    assert t.decode_micro_batches == 2 and t.prefill_micro_batches == 4 and t.mu_n == 16
    # LLM-PQ's runtime keeps the head with the embeddings on the first stage: the last stage
    # holds only its layers and temporaries, the first no second copy of a tied head
    paper = tables_for(cluster, replace(cost, runtime="llm-pq"), work, order, 2)
    first, last = order[0].budget_bytes() - paper.budgets[0], order[1].budget_bytes() - paper.budgets[1]
    assert first - last == pytest.approx(mem.extras_bytes(2, 4, True, True) - mem.extras_bytes(2, 4, False, False))


def test_heuristic_is_close_to_the_ilp_optimum():
    for seed in range(3):
        t = random_tables(seed, 6, 2)
        from tessera.pipeline import heuristic
        start = ilp.solve_quality(t).assignment
        a = heuristic.improve(t, start)
        opt = ilp.solve(t).assignment
        best = reference_objective(t, opt.device, opt.bits, "paper")
        got = reference_objective(t, a.device, a.bits, "paper")
        assert fits(t, a.device, a.bits) and got <= reference_objective(t, start.device, start.bits, "paper")
        assert got <= 1.15 * best


def test_evaluate_reports_an_assignment_as_the_brute_force_does():
    t = random_tables(3, 4, 3)
    a = Assignment((0, 1, 1, 2), (16, 8, 4, 8))
    assert ilp.evaluate(t, a, "rounds").objective == pytest.approx(reference_objective(t, a.device, a.bits, "rounds"))


def test_a_plans_topology_runs_its_stages_as_planned(tmp_path):
    """`tessera plan pq --topology`: the file `tessera up` reads gives each stage the plan's
    layers, the plan file (per-layer bits), its device's threads and memory budget."""
    import json

    import yaml

    from tessera.deploy.topology import Topology
    from tessera.pipeline.plan_topology import plan_topology
    cluster, cost, work = small_case(fast_mem=0.03, slow_mem=0.02)
    cluster = Cluster(tuple(replace(d, threads=i + 1) for i, d in enumerate(cluster.devices)))
    plan = plan_method("llm-pq", cluster, cost, work)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan.to_dict(), "bits": list(plan.layer_bits)}))
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump(plan_topology(plan, {d.name: d for d in cluster.devices}, plan_file, "random:llama")))
    procs = [p for p in Topology.load(topo).processes() if p.role == "pipeline_shard"]
    assert len(procs) == len(plan.stages)
    for p, s in zip(procs, plan.stages):
        argv = " ".join(p.argv)
        device = next(d for d in cluster.devices if d.name == s.device)
        assert f"--layers {s.start}:{s.end}" in argv and f"--quantization {plan_file}" in argv
        assert f"--threads {device.threads}" in argv and f"--memory-gib {device.memory_gib}" in argv
    # stage 0 prefills the B prompts of a batch together (they arrive over a few ms)
    assert f"--max-num-seqs {plan.batch} " in " ".join(procs[0].argv) + " "
    assert "--max-queue-delay-ms" in procs[0].argv


def test_predict_costs_a_plan_at_workloads_it_was_not_made_for():
    from tessera.pipeline.planner import predict
    cluster, cost, work = small_case()
    plan = plan_method("llm-pq", cluster, cost, work)
    same = predict(plan, cluster, cost, work)
    assert (same.prefill_s, same.decode_s) == pytest.approx((plan.prefill_s, plan.decode_s))
    longer = predict(plan, cluster, cost, dataclasses.replace(work, gen_len=2 * work.gen_len))
    assert longer.prefill_s == pytest.approx(plan.prefill_s) and longer.decode_s > 1.9 * plan.decode_s
    # fewer prompts than ξ: one prefill micro-batch of that many prompts, not of ξ (unclamped,
    # both would cost the same)
    assert plan.xi > 1
    one = predict(plan, cluster, cost, dataclasses.replace(work, batch=1)).prefill_s
    full = predict(plan, cluster, cost, dataclasses.replace(work, batch=plan.xi)).prefill_s
    assert one < 0.9 * full
    # ξ + 1 prompts: a full micro-batch, then one of a single prompt (not a second of ξ)
    odd = predict(plan, cluster, cost, dataclasses.replace(work, batch=plan.xi + 1))
    two = predict(plan, cluster, cost, dataclasses.replace(work, batch=2 * plan.xi))
    assert full < odd.prefill_s < two.prefill_s
    assert odd.prefill_s == pytest.approx(full + max(predict(plan, cluster, cost, dataclasses.replace(
        work, batch=1)).pre))


def test_stage_seconds_are_each_stages_micro_batches_over_the_workload():
    """One stage does all the work, so its time is the whole prediction; with more stages each
    stage's time is its prefill micro-batches and decode micro-batches, so the slowest stage
    bounds the pipelined whole from below and the stages' sum bounds it from above."""
    from tessera.pipeline.planner import predict, stage_seconds
    cluster, cost, work = small_case()
    plan = plan_method("llm-pq", cluster, cost, work)
    assert len(plan.stages) > 1
    for w in (work, dataclasses.replace(work, batch=plan.xi + 1)):
        ev, per_stage = predict(plan, cluster, cost, w), stage_seconds(plan, cluster, cost, w)
        assert len(per_stage) == len(plan.stages)
        assert max(per_stage) <= ev.prefill_s + ev.decode_s <= sum(per_stage) * (1 + 1e-9)
    one = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], start=0, end=plan.stages[-1].end),))
    assert plan.xi > 1
    for w in (work, dataclasses.replace(work, batch=plan.xi + 1)):    # the second: a partial last micro-batch
        ev = predict(one, cluster, cost, w)
        assert stage_seconds(one, cluster, cost, w) == pytest.approx((ev.prefill_s + ev.decode_s,))


@pytest.mark.parametrize("stages", [1, 2])
def test_bench_pq_reference_deployments_are_dense_stages_that_run(tmp_path, stages):
    """The deployments bench pq measures the overheads on: every layer at 16 bits in one or two
    equal stages on the first device's type, a topology `tessera up` accepts (no memory budget
    to refuse it) and a prediction of its own."""
    import json

    import yaml

    from tessera.bench.pq_bench import reference
    from tessera.deploy.topology import Topology
    from tessera.pipeline.plan_topology import plan_topology
    cluster, cost, work = small_case(fast_mem=0.006, slow_mem=0.006)
    plan, devices, ring = reference({"llm-pq": plan_method("llm-pq", cluster, cost, work)}, cluster, cost, work, stages)
    assert plan.layer_bits == (16,) * SHAPE.layers and [s.device for s in plan.stages] == [d.name for d in devices]
    assert len(devices) == stages and {d.type for d in devices} == {cluster.devices[0].type}
    assert plan.throughput_tok_s > 0
    plan_file = tmp_path / "ref.json"
    plan_file.write_text(json.dumps({**plan.to_dict(), "bits": list(plan.layer_bits)}))
    topo = tmp_path / "ref.yaml"
    topo.write_text(yaml.safe_dump(plan_topology(plan, {d.name: d for d in devices}, plan_file, "random:llama")))
    shards = [p for p in Topology.load(topo).processes() if p.role == "pipeline_shard"]
    cuts = [0, SHAPE.layers] if stages == 1 else [0, round(SHAPE.layers / 2), SHAPE.layers]
    assert [p.argv[p.argv.index("--layers") + 1] for p in shards] == [f"{x}:{y}" for x, y in zip(cuts, cuts[1:])]


def test_bench_pq_workloads_and_calibration():
    """Held-out workloads larger than the planned one are refused (the plan's budgets would not
    hold them); the overheads fitted on one plan's runs predict the others."""
    from types import SimpleNamespace

    from tessera.bench.pq_bench import calibrate, workloads
    a = SimpleNamespace(batch=8, prompt_len=64, gen_len=32, heldout="4,64,32;8,32,48")
    assert workloads(a) == [(8, 64, 32), (4, 64, 32), (8, 32, 48)]
    for bad in ("16,64,32", "8,64,64", "8,64", "a,b,c", "0,8,8"):
        with pytest.raises(SystemExit):
            workloads(SimpleNamespace(batch=8, prompt_len=64, gen_len=32, heldout=bad))

    def run(n, predicted_prefill, predicted_decode, prefill_over=0.1, step_over=0.01):
        return {"gen_len": n, "predicted_prefill_s": predicted_prefill, "predicted_decode_s": predicted_decode,
                "predicted_s": predicted_prefill + predicted_decode,
                "measured_prefill_s": predicted_prefill + prefill_over,
                "measured_decode_s": predicted_decode + (n - 1) * step_over,
                "measured_s": predicted_prefill + prefill_over + predicted_decode + (n - 1) * step_over}
    rows = [{"plan": "uniform", "workloads": [run(32, 0.3, 0.5), run(48, 0.2, 0.8)]},
            {"plan": "llm-pq", "workloads": [run(32, 0.2, 0.4), run(16, 0.1, 0.2)]}]
    assert calibrate(rows, "uniform") == {"plan": "uniform", "prefill_overhead_ms": 100.0,
                                          "overhead_per_decode_step_ms": 10.0}
    assert all(w["calibrated_error_pct"] == w["calibrated_prefill_error_pct"] == w["calibrated_decode_error_pct"] == 0.0
               for w in rows[1]["workloads"])
    assert "calibrated_error_pct" not in rows[0]["workloads"][0]
    # overheads measured on one- and two-stage references outside the rows: a + h·(stages − 1)
    from tessera.bench.pq_bench import profiled
    refs = [{"plan": "reference-1", "stages": 1, "workloads": [run(32, 0.5, 0.9)]},
            {"plan": "reference-2", "stages": 2, "workloads": [run(32, 0.5, 0.9, 0.12, 0.013)]}]
    rows[0]["stages"], rows[1]["stages"] = 1, 2
    rows[1]["workloads"] = [run(32, 0.2, 0.4, 0.12, 0.013), run(16, 0.1, 0.2, 0.12, 0.013)]
    assert profiled(rows, refs) == {"prefill_overhead_ms": 100.0, "prefill_per_hop_ms": 20.0,
                                    "overhead_per_decode_step_ms": 10.0, "decode_step_per_hop_ms": 3.0,
                                    "reference_stages": [1, 2]}
    assert all(w["profiled_error_pct"] == 0.0 for r in rows for w in r["workloads"])
    assert profiled(rows, refs[1:]) is None
    assert calibrate(rows, "pipeedge") is None
    # each stage's compute against its prediction, summarized apart (nothing added to it)
    from tessera.bench.pq_bench import summary
    rows[1]["workloads"][0]["stages"] = [{"measured_s": 1.0, "predicted_s": 0.9, "error_pct": -10.0},
                                         {"measured_s": 0.5, "predicted_s": 0.52, "error_pct": 4.0}]
    assert summary(rows)["stage_error_pct"] == {"mean_abs": 7.0, "max_abs": 10.0, "points": 2}
