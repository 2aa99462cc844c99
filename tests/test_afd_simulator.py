"""The AFD simulator and profiles (pure Python, no processes, no timing): hand-traced
timelines on a fixed synthetic profile, MegaScale-Infer's Eq. 5 and its minimum m, and the
profile's fits and interpolation."""
from __future__ import annotations

import json
import math

import pytest

from tessera.disagg.profile import build_profile, fit, load_profile, profile_model, profile_sizes
from tessera.disagg.simulator import Linear, StepModel, micro_batch_sizes, paper_total, simulate

# A fixed synthetic profile (ms) at the sizes bench afd's B = 256 with m = 1, 2, 3 asks about.
SYNTHETIC = [{"batch": b, "t_a_ms": a, "t_e_ms": e, "t_c_ms": 0.5, "t_o_ms": 1.0}
             for b, a, e in ((85, 1.5, 2.5), (86, 1.6, 2.6), (128, 2.0, 3.0), (256, 4.0, 4.0))]


def synthetic() -> StepModel:
    return profile_model(build_profile(SYNTHETIC, layers=2))


def const(t: float) -> Linear:
    return Linear(0.0, t)


def test_the_profile_covers_every_micro_batch_size_the_simulator_uses():
    assert micro_batch_sizes(256, 3) == [86, 85, 85]
    assert profile_sizes(256, [1, 2, 3]) == [85, 86, 128, 256] == [r["batch"] for r in SYNTHETIC]
    assert profile_sizes(256, [1, 2, 3, 4], extra=[8, 16]) == [8, 16, 64, 85, 86, 128, 256]


def test_synthetic_profile_m1_is_the_sum_of_its_parts():
    assert simulate(synthetic(), 256, 1) == pytest.approx(2 * (4 + 0.5 + 4 + 0.5) * 1e-3 + 1e-3)


def test_synthetic_profile_m2_follows_the_traced_timeline():
    """Layer 0: attention runs mb0 [0, 2], mb1 [2, 4]; the expert mb0 [2.5, 5.5] (back 6),
    mb1 [5.5, 8.5] (back 9). Layer 1: attention mb0 [6, 8], mb1 [9, 11]; the expert mb0
    [8.5, 11.5], mb1 [11.5, 14.5], back at 15; T_o(256) = 1: 16 ms."""
    assert simulate(synthetic(), 256, 2) == pytest.approx(16e-3)


def test_synthetic_profile_m3_uses_both_split_sizes():
    """Micro-batches of 86, 85, 85 (measured: T_a 1.6 / 1.5, T_e 2.6 / 2.5). Layer 0:
    attention [0, 1.6], [1.6, 3.1], [3.1, 4.6]; expert [2.1, 4.7], [4.7, 7.2], [7.2, 9.7].
    Layer 1: attention [5.2, 6.8], [7.7, 9.2], [10.2, 11.7]; expert [9.7, 12.3],
    [12.3, 14.8], [14.8, 17.3], back at 17.8; + T_o 1: 18.8 ms."""
    assert simulate(synthetic(), 256, 3) == pytest.approx(18.8e-3)


def test_several_attention_nodes_per_expert_node_traced():
    """M = 2 attention nodes of B = 128, m = 1. Tessera's expert node computes each node's
    micro-batch alone: layer 0 [2.5, 5.5], [5.5, 8.5]; layer 1 [8.5, 11.5], [11.5, 14.5],
    the second node's reply back at 15: 16 ms. MegaScale-Infer's expert computes both as one
    batch of 256: [2.5, 6.5], back 7; attention [7, 9]; [9.5, 13.5], back 14: 15 ms."""
    model = synthetic()
    assert simulate(model, 128, 1, attention_nodes=2) == pytest.approx(16e-3)
    assert simulate(model, 128, 1, attention_nodes=2, aggregate=True) == pytest.approx(15e-3)
    assert simulate(model, 128, 1, attention_nodes=1, aggregate=True) == simulate(model, 128, 1)


@pytest.mark.parametrize("t_a,t_e,t_c,m", [(2e-3, 2e-3, 0.4e-3, 3), (3e-3, 2e-3, 0.5e-3, 4), (1e-3, 2e-3, 0.2e-3, 3)])
def test_simulator_matches_megascale_eq5_when_eq3_holds(t_a, t_e, t_c, m):
    t_f = max(t_a, t_e)
    assert m * t_f >= 2 * (t_f + t_c)
    model = StepModel(const(t_a), const(t_e), const(t_c), const(0.0), layers=6)
    assert simulate(model, 96, m) == pytest.approx(paper_total(t_a, t_e, t_c, m, 6), rel=1e-9)


@pytest.mark.parametrize("ratio,m_min", [(0.1, 3), (0.4, 3), (0.6, 4), (0.9, 4)])
def test_bubbles_vanish_at_the_papers_minimum_m(ratio, m_min):
    """MegaScale-Infer §4.1: m >= 2 (1 + T_c / T_f); m = 3 suffices when T_c < T_f / 2, slower
    links need 4. Below that, the simulated step is longer than Eq. 5 (the pipeline stalls)."""
    t_f = 1e-3
    model = StepModel(const(t_f), const(t_f), const(ratio * t_f), const(0.0), layers=6)
    no_bubble = [m for m in range(1, 8)
                 if simulate(model, 96, m) == pytest.approx(paper_total(t_f, t_f, ratio * t_f, m, 6), rel=1e-9)]
    assert no_bubble[0] == m_min == math.ceil(2 * (1 + ratio))
    assert all(m in no_bubble for m in range(m_min, 8))


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


def test_plan_afd_refuses_a_profile_of_another_machine_kind(tmp_path, capsys):
    """A profile records its machine; planning with one from another kind of CPU exits 78 and
    names the command that profiles here, whose copy (FILE.KIND.json) is then used."""
    from tessera.cli import main
    from tessera.machine_profiles import recorded_machine
    rows = [{"batch": b, "t_a_ms": 0.1 * b, "t_e_ms": 2 + 0.05 * b, "t_c_ms": 0.3, "t_o_ms": 1.0} for b in (8, 64)]
    here = recorded_machine()
    other = next(k for k in ("zen5", "xeon-amx") if k != here["kind"])
    taken = {"model": "random:mixtral", "prompt_len": 32, "steps": 48, "transport": "tcp"}
    path = tmp_path / "p.json"
    profile = dict(build_profile(rows, layers=4), taken=taken)
    path.write_text(json.dumps(dict(profile, machine=dict(here, kind=other))))
    plan = ["plan", "afd", "--profile", str(path), "--out", str(tmp_path / "plan.yaml")]
    assert main(plan) == 78
    message = capsys.readouterr().err
    assert f"profiled on {other}, and this machine is {here['kind']}" in message
    assert "tessera profile --model random:mixtral --prompt-len 32 --steps 48 --transport tcp" in message
    (tmp_path / f"p.{here['kind']}.json").write_text(json.dumps(dict(profile, machine=here)))
    assert main(plan) == 0 and (tmp_path / "plan.yaml").exists()
