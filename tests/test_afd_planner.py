"""The AFD performance model, simulator and plan search (pure Python, no processes)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tessera.deploy.topology import Topology
from tessera.disagg import planner
from tessera.disagg.plan_cli import main as plan_main
from tessera.disagg.profile import build_profile, fit, load_profile
from tessera.disagg.simulator import Linear, StepModel, paper_total, simulate


def const(t: float) -> Linear:
    return Linear(0.0, t)


def test_simulator_without_pipeline_is_the_sum_of_its_parts():
    model = StepModel(const(2e-3), const(3e-3), const(0.5e-3), const(1e-3), layers=4)
    assert simulate(model, 32, m=1) == pytest.approx(4 * (2e-3 + 3e-3 + 2 * 0.5e-3) + 1e-3)


@pytest.mark.parametrize("t_a,t_e,t_c,m", [(2e-3, 2e-3, 0.4e-3, 3), (3e-3, 2e-3, 0.5e-3, 4), (1e-3, 2e-3, 0.2e-3, 3)])
def test_simulator_matches_megascale_eq5_when_eq3_holds(t_a, t_e, t_c, m):
    t_f = max(t_a, t_e)
    assert m * t_f >= 2 * (t_f + t_c)
    model = StepModel(const(t_a), const(t_e), const(t_c), const(0.0), layers=6)
    assert simulate(model, 96, m) == pytest.approx(paper_total(t_a, t_e, t_c, m, 6), rel=1e-9)


def test_pipeline_helps_only_when_expert_time_scales_with_tokens():
    scales = StepModel(Linear(1e-4, 0), Linear(1e-4, 0), const(1e-4), const(0), layers=4)
    fixed = StepModel(Linear(1e-4, 0), Linear(0, 3.2e-3), const(1e-4), const(0), layers=4)
    assert simulate(scales, 32, 2) < 0.8 * simulate(scales, 32, 1)
    assert simulate(fixed, 32, 2) > simulate(fixed, 32, 1)


def test_fit_recovers_a_line_and_profiles_round_trip(tmp_path):
    line = fit([8, 32, 64], [0.001 + 8e-5, 0.001 + 32e-5, 0.001 + 64e-5])
    assert line.slope == pytest.approx(1e-5) and line.intercept == pytest.approx(1e-3)
    rows = [{"batch": b, "t_a_ms": 0.1 * b, "t_e_ms": 2 + 0.05 * b, "t_c_ms": 0.3, "t_o_ms": 1.0} for b in (8, 64)]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(build_profile(rows, layers=4)))
    model = load_profile(path)
    assert model.t_a(10) == pytest.approx(1e-3) and model.t_e(0) == pytest.approx(2e-3)
    assert model.t_a.slope == pytest.approx(1e-4) and model.t_e.intercept == pytest.approx(2e-3)


def test_simulator_interpolates_measured_points_and_fits_outside_them(tmp_path):
    """An MoE expert's time is concave in b at small b: between measured batches the model
    follows the measurements, not the line through all of them."""
    rows = [{"batch": b, "t_a_ms": 1.0, "t_e_ms": e, "t_c_ms": 0.1, "t_o_ms": 1.0}
            for b, e in ((8, 10.0), (16, 16.0), (32, 17.0), (256, 40.0))]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(build_profile(rows, layers=4)))
    t_e = load_profile(path).t_e
    assert t_e(16) == pytest.approx(16e-3) and t_e(24) == pytest.approx(16.5e-3)
    assert t_e(512) == pytest.approx(t_e.fit(512)) and t_e(4) == pytest.approx(t_e.fit(4))
    assert t_e.fit(16) < 14e-3   # the line alone would miss the measured 16 ms


def test_algorithm1_plans_meet_every_constraint_and_balance():
    shape = planner.MODELS["mixtral-8x22b"]
    plan = planner.search(shape, ["H20"], ["L40S"], slo_s=0.150)
    assert plan is not None and all(plan.checks.values())
    assert plan.t_total <= 0.150 and plan.m >= 3
    k1, _ = planner.attention_fit(shape, planner.GPUS["H20"], plan.tp_a)
    k3, _ = planner.expert_fit(shape, planner.GPUS["L40S"], plan.tp_e)
    assert plan.n_a == max(1, round(k1 * shape.experts / (k3 * shape.top_k)))
    assert planner.search(shape, ["H20"], ["L40S"], slo_s=1e-4) is None     # no plan meets 0.1 ms


def test_heterogeneous_search_is_at_least_as_good_as_homogeneous():
    shape = planner.MODELS["dbrx"]
    names = list(planner.GPUS)
    homogeneous = max(planner.search(shape, [g], [g]).tpuc for g in names)
    assert planner.search(shape, names, names).tpuc >= homogeneous


def test_plan_here_writes_a_topology_tessera_up_accepts(tmp_path):
    rows = [{"batch": b, "t_a_ms": 0.05 * b, "t_e_ms": 0.05 * b, "t_c_ms": 0.2, "t_o_ms": 1.0} for b in (8, 64, 256)]
    profile, out = tmp_path / "p.json", tmp_path / "plan.yaml"
    profile.write_text(json.dumps(build_profile(rows, layers=4)))
    plan_main(SimpleNamespace(profile=str(profile), slo_ms=150.0, serve_model="random:mixtral", out=str(out)))
    topology = Topology.load(out)
    assert topology.roles["attention_node"].options["micro_batches"] >= 2   # overlap pays here
