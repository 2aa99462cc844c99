"""LLM-PQ's cost models and inputs: the memory model against the model's real shapes and the
runtime's own quantized-weight accounting, the latency regressions (coefficients recovered,
the profiled range kept), the link fit, devices.yaml, `tessera profile pq` on a tiny model, and
`tessera plan pq` as a user runs it."""
from __future__ import annotations

import json
import math

import pytest

from tessera.pipeline.costmodel import SHAPES, Link, MemoryModel, ModelShape, Piecewise, Regression, linear_bytes
from tessera.pipeline.devices import GPU_RESERVED, load_cluster, load_gpu_specs

SMOL = ModelShape("smollm2", "llama", 30, 576, 1536, 9, 3, 64, 49152)


def test_memory_model_uses_the_real_layer_shapes():
    """SmolLM2-135M (docs/design/pipeline.md#virtual-devices): 0.88 M attention + 2.65 M MLP
    parameters per layer."""
    attn = sum(a * b for n, a, b in SMOL.linears() if n in "qkvo")
    mlp = sum(a * b for n, a, b in SMOL.linears() if n in ("gate", "up", "down"))
    assert (attn, mlp) == (884_736, 2_654_208)
    mem = MemoryModel(SMOL)
    assert mem.weight_bytes(16) == 2 * (attn + mlp + 2 * 576)
    # int8: a byte per weight and a 16-bit scale per output row; int4: half a byte and a
    # 16-bit (scale, offset) per group of 32 inputs
    rows = sum(b for _, _, b in SMOL.linears())
    groups = sum(b * a // 32 for _, a, b in SMOL.linears())
    assert mem.weight_bytes(8) == attn + mlp + 2 * rows + 2 * 2 * 576
    assert mem.weight_bytes(4) == (attn + mlp) / 2 + 4 * groups + 2 * 2 * 576
    assert mem.kv_bytes(32, 192) == 32 * 2 * 3 * 64 * 192 * 2


def test_weight_bytes_agree_with_the_runtime_quantizer():
    quant = pytest.importorskip("tessera.layers.quant")
    for fan_in, fan_out in ((576, 192), (1536, 576)):
        for bits in (16, 8, 4, 3):
            assert linear_bytes(fan_in, fan_out, bits, 32, int3_as_int4=True) == quant.linear_weight_bytes(
                fan_out, fan_in, bits, 32)


def test_published_shapes_give_the_published_sizes():
    """OPT-13B/30B/66B and BLOOM-176B: parameter counts from the built-in dims (within 2 %)."""
    for name, billions in (("opt-13b", 12.9), ("opt-30b", 30.0), ("opt-66b", 65.7), ("bloom-176b", 176.2)):
        s = SHAPES[name]
        total = s.layers * s.layer_params() + (s.vocab + s.positions) * s.hidden
        assert total / 1e9 == pytest.approx(billions, rel=0.02), name


def test_regression_recovers_coefficients_and_stays_in_the_profiled_box():
    coef = (2e-5, 1e-6, 3e-6, 4e-9, 1e-4)

    def truth(b, s):
        return sum(c * f for c, f in zip(coef, (b, s, b * s, b * s * s, 1.0)))
    pts = [(b, s, 0, truth(b, s)) for b in (1, 2, 4, 8) for s in (32, 64, 128)]
    r = Regression.fit("prefill", pts)
    assert r.coef == pytest.approx(coef, rel=1e-6)
    assert r.predict(3, 100) == pytest.approx(truth(3, 100), rel=1e-9)
    assert r.predict(64, 1024) == pytest.approx(truth(8, 128))            # clamped, not extrapolated
    assert r.covers(4, 64) and not r.covers(16, 64)
    # a fit with a negative intercept: at b = 1 it would say 1e-4 * 10 - 5e-3 < 0; b is clamped to
    # the profiled 16 instead, and no prediction falls below the fastest measured time
    neg = Regression("decode", (1e-4, 0.0, 0.0, -5e-3), (16, 1, 0), (64, 256, 0), 1e-3)
    assert neg.predict(1, 10) == pytest.approx(1e-4 * 16 * 10 - 5e-3)
    assert Regression("decode", neg.coef, neg.lo, neg.hi, 0.02).predict(1, 10) == 0.02
    assert Regression.from_dict(r.to_dict()) == r


def test_piecewise_decode_fit_has_one_regression_per_kernel_regime():
    """Up to 16 rows a GEMV that reads the weights once per pass of 4 rows (5 rows cost what 8
    do), above it a GEMM (a fixed dequantize, then a cheaper slope): one fit per regime recovers
    both; a single fit misses by far more."""
    def truth(b, s, i):
        if b <= 16:
            return 2e-4 + 1e-5 * b + 6e-5 * math.ceil(b / 4) + 1e-8 * b * (s + i)
        return 9e-4 + 1e-5 * b + 1e-8 * b * (s + i)
    pts = [(b, s, i, truth(b, s, i)) for b in (1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 48)
           for s, i in ((32, 0), (128, 96), (64, 32))]
    pw = Piecewise.fit("decode", pts, ((16, 4), (0, 1)))
    assert pw.splits == (16,) and [r.rows_per_pass for r in pw.pieces] == [4, 1]
    for b in (5, 7, 16, 24, 40):
        assert pw.predict(b, 64, 16) == pytest.approx(truth(b, 64, 16), rel=1e-6), b
    assert pw.predict(17, 64, 16) == pytest.approx(truth(20, 64, 16), rel=1e-6)     # clamped into its regime's box
    single = Regression.fit("decode", pts)
    assert max(abs(single.predict(b, s, i) / t - 1) for b, s, i, t in pts) > 0.2
    # a regime with too few points is merged into the next one
    assert Piecewise.fit("decode", pts, ((1, 1), (16, 4), (0, 1))).splits == (16,)
    assert Piecewise.from_dict(pw.to_dict()) == pw
    assert Piecewise.from_dict(single.to_dict()) == Piecewise((), (single,))     # a profile from before the pieces


def test_decode_regimes_are_where_the_linears_change_kernel(monkeypatch):
    """The regimes the profile fits by are the row counts at which the forwards switch kernel:
    from the C GEMVs to torch's packed int8 kernel or a bf16 GEMM (oneDNN, or F.linear on
    dequantized weights). The path is the same throughout a regime and changes at each boundary."""
    import torch
    import torch.nn.functional as F

    from tessera.layers.linear import Linear
    from tessera.layers.quant import decode_regimes, quantized_linear
    from tessera_kernels import gemv_cpu, gemv_quant_cpu
    if not (gemv_cpu.available() and gemv_quant_cpu.available()):
        pytest.skip("no C compiler: every linear has one kernel")
    calls = []
    for mod, name in ((gemv_cpu, "gemv_bf16"), (gemv_quant_cpu, "gemv_q8"), (gemv_quant_cpu.Q4Weight, "gemv"),
                      (F, "linear")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))

    def path(layer, rows: int) -> tuple[str, ...]:
        calls.clear()
        layer(torch.randn(rows, 192, dtype=torch.bfloat16))
        return tuple(sorted(set(calls)))
    torch.manual_seed(0)
    dense = Linear(192, 64, bias=False).to(torch.bfloat16)
    for bits, layer in ((16, dense), (8, quantized_linear(dense, 8)), (4, quantized_linear(dense, 4)),
                        (3, quantized_linear(dense, 3))):
        regimes = decode_regimes(bits, torch.bfloat16)
        assert regimes[-1][0] == 0 and len(regimes) >= 2
        lo = 1
        for most, _ in regimes[:-1]:
            if bits in (3, 4) and most == 1:      # one row or several: two paths inside the C GEMV
                assert path(layer, 1) == path(layer, 2) == ("gemv",)
                continue
            assert path(layer, lo) == path(layer, most) != path(layer, most + 1), (bits, most)
            lo = most + 1
        assert path(layer, 1) in (("gemv_bf16",), ("gemv_q8",), ("gemv",))    # a GEMV first
    assert decode_regimes(16, torch.float32) == ((0, 1),)


def test_link_fit_recovers_latency_and_bandwidth():
    link = Link(20e-6, 12.5)
    fitted = Link.fit([(n, link.time(n)) for n in (1e3, 1e5, 1e6, 1e7)])
    assert fitted.latency_s == pytest.approx(20e-6) and fitted.bandwidth_gbs == pytest.approx(12.5)
    with pytest.raises(ValueError):
        Link.fit([(1e3, 1e-5), (1e3, 2e-5)])


def test_devices_yaml(tmp_path):
    (tmp_path / "p.json").write_text("{}")
    (tmp_path / "devices.yaml").write_text(
        "devices:\n"
        "  - {name: t4, type: T4, count: 3}\n"
        "  - {name: cpu, type: cpu-2t, memory_gib: 0.5, threads: 2, profile: p.json, slowdown: 1.5}\n"
        "links:\n"
        "  - {between: [T4, cpu-2t], latency_us: 10, bandwidth_gbs: 2}\n"
        "  - {between: [t4-0, t4-1], points: [[1000, 1.0e-6], [1000000, 1.0e-4]]}\n"
        "default_link: {bandwidth_gbs: 100}\n")
    c = load_cluster(tmp_path / "devices.yaml")
    assert [d.name for d in c.devices] == ["t4-0", "t4-1", "t4-2", "cpu"]
    t4, cpu = c.devices[0], c.devices[3]
    assert t4.gpu == "T4" and t4.memory_gib == load_gpu_specs()["T4"].memory_gib
    assert t4.budget_bytes() == pytest.approx(0.95 * 16 * 2 ** 30 - GPU_RESERVED)
    assert cpu.profile == str(tmp_path / "p.json") and cpu.budget_bytes() == 0.5 * 2 ** 30
    assert c.link(t4, cpu).latency_s == pytest.approx(10e-6)                # by type
    assert c.link(c.devices[1], t4).time(1e6) == pytest.approx(1e-4, rel=1e-6)   # by name, fitted
    assert c.link(c.devices[1], c.devices[2]).bandwidth_gbs == 100            # default
    (tmp_path / "bad.yaml").write_text("- {name: x, type: cpu, memory_gib: 1}\n")
    with pytest.raises(ValueError, match="exactly one"):
        load_cluster(tmp_path / "bad.yaml")


def test_gpu_specs_are_complete():
    specs = load_gpu_specs()
    assert set(specs) >= {"T4", "P100-12G", "V100-32G", "A100-40G", "A100-80G", "A800-80G"}
    for s in specs.values():
        assert s.source.startswith("NVIDIA") and s.bandwidth_gbs > 0 and s.fp16_tflops > 0


def test_roofline_runs_the_kernels_llm_pq_ran():
    """roofline.KERNELS: 8-bit is LLM.int8() without igemmlt (an int8 -> FP16 cast, then the
    FP16 GEMM), so it is slower than FP16; GPTQ 3/4-bit is an FP32 matrix-vector kernel run once
    per token, at the datasheet's fp32_tflops read from gpu_specs.yaml."""
    from dataclasses import replace

    from tessera.pipeline.roofline import Roofline
    spec = load_gpu_specs()["V100-32G"]
    assert spec.fp32_tflops == 15.7 and spec.fp16_tflops == 125
    mem = MemoryModel(SHAPES["opt-30b"], group_size=128)
    params = sum(a * b for _, a, b in mem.shape.linears())
    v100 = Roofline(spec, mem)
    # decode is memory-bound: LLM.int8() moves 3 more bytes per weight (the cast) than FP16
    assert v100.decode(8, 8, 512, 50) - v100.decode(16, 8, 512, 50) == pytest.approx(3 * params / 900e9, rel=1e-9)
    assert v100.prefill(8, 2, 512) > v100.prefill(16, 2, 512)
    # GPTQ: one token reads the packed weight once (faster than FP16), eight tokens read it eight times
    stored = mem.weight_bytes(4) - 2 * mem.shape.small_params()
    assert v100.decode(4, 1, 512, 50) < v100.decode(16, 1, 512, 50) / 3
    assert v100.decode(4, 8, 512, 50) > 8 * stored / 900e9
    # with unlimited bandwidth only the math is left: the linears at the FP32 (GPTQ) or FP16 rate
    fast = Roofline(replace(spec, bandwidth_gbs=1e12), mem)
    tokens = 2 * 512
    gap = 2 * tokens * params * (1 / 15.7e12 - 1 / 125e12)
    assert fast.prefill(4, 2, 512) - fast.prefill(16, 2, 512) == pytest.approx(gap, rel=1e-6)
    assert fast.prefill(3, 2, 512) == pytest.approx(fast.prefill(4, 2, 512), rel=1e-9)


def test_profile_pq_fits_a_real_layer(tiny_models, tmp_path, monkeypatch, capsys):
    """The profile's code path on a tiny random Llama (2 layers: bits 16 and 8) at a few
    points; the fitted profile then drives a plan."""
    from types import SimpleNamespace

    import torch

    from tessera import engine
    from tessera.pipeline import profile
    from tessera.pipeline.costmodel import ProfiledLatency
    monkeypatch.setattr(engine, "resolve_dtype", lambda *a: torch.float32)   # auto where bf16 tiles are not built
    monkeypatch.setattr(profile, "PREFILL", [(b, s) for b in (1, 2, 4) for s in (8, 16)])
    monkeypatch.setattr(profile, "DECODE", [(b, s, i) for b in (1, 4) for s, i in ((8, 0), (16, 8))])
    monkeypatch.setattr(profile, "HELD_PREFILL", [(3, 12)])
    monkeypatch.setattr(profile, "HELD_DECODE", [(2, 12, 4)])
    monkeypatch.setattr(profile, "PREPOST_PREFILL", [(1, 8), (2, 8), (4, 16)])
    monkeypatch.setattr(profile, "PREPOST_DECODE", [1, 4])
    out = tmp_path / "prof.json"
    profile.main(SimpleNamespace(model=tiny_models["llama"], out=str(out), threads=1, bits="16,8", group_size=32,
                                 reps=1, neighbours=None))
    data = json.loads(out.read_text())
    assert data["bits"] == [16, 8] and len(data["held_out"]) == 4
    assert all(p["seconds"] > 0 for p in data["points"]["decode"])
    lat = ProfiledLatency.from_profile(data)
    assert lat.bits == (8, 16) and lat.decode(8, 2, 12, 4) > 0 and lat.outside(32, 16, 4, 4) == ["prefill (b=32, s=16)"]
    # bf16 whatever --dtype auto picks: the dtype pipelines serve; a float32 profile would
    # cost another runtime, and `plan pq` refuses it
    assert data["dtype"] == "bfloat16"
    out.write_text(json.dumps({**data, "dtype": "float32"}))
    (tmp_path / "devices.yaml").write_text(f"- {{name: a, type: cpu, memory_gib: 1, profile: {out}}}\n")
    from tessera.cli import main
    plan = ["plan", "pq", "--devices", str(tmp_path / "devices.yaml"), "--model", tiny_models["llama"],
            "--batch", "2", "--prompt-len", "8", "--gen-len", "4", "--out", str(tmp_path / "plan.json")]
    with pytest.raises(SystemExit, match="taken in float32"):
        main(plan)
    # taken on another kind of CPU: refused (exit 78), naming the command that profiles here;
    # the copy that command writes beside it is used instead
    here = data["machine"]["kind"]
    other = next(k for k in ("zen5", "xeon-amx") if k != here)
    out.write_text(json.dumps({**data, "machine": {**data["machine"], "kind": other}}))
    assert main(plan) == 78
    message = capsys.readouterr().err
    assert f"profiled on {other}, and this machine is {here}" in message
    assert f"tessera profile-pq --model {tiny_models['llama']} --threads 1 --bits 16,8 --group-size 32" in message
    (tmp_path / f"prof.{here}.json").write_text(json.dumps(data))
    assert main(plan) == 0


def test_plan_pq_cli_writes_a_valid_plan(tmp_path, capsys):
    """`tessera plan pq` on two simulated GPUs for OPT-13B: a table beside the baselines and a
    plan file with the runtime's "bits" and "stages"."""
    from tessera.cli import main
    (tmp_path / "devices.yaml").write_text("- {name: a, type: A100-40G}\n- {name: v, type: V100-32G}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "pq", "--devices", str(tmp_path / "devices.yaml"), "--model", "opt-13b", "--batch", "16",
                 "--prompt-len", "128", "--gen-len", "32", "--time-limit-s", "20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("llm-pq", "pipeedge", "uniform", "adabits", "simulated (roofline)", "fallback", "not modelled"):
        assert word in text
    plan = json.loads(out.read_text())
    assert len(plan["bits"]) == 40 and plan["stages"][0]["start"] == 0 and plan["stages"][-1]["end"] == 40
    assert [s["end"] for s in plan["stages"][:-1]] == [s["start"] for s in plan["stages"][1:]]
    assert plan["label"] == "simulated (roofline)" and math.isclose(
        plan["throughput_tok_s"], 16 * 32 / (plan["prefill_s"] + plan["decode_s"]))


def test_paper_case_is_labelled_simulated():
    from tessera.pipeline.paper_cases import CASES, run_case, summarize
    row = run_case(CASES[0], time_limit_s=20)
    assert row["label"] == "simulated (roofline)"
    assert set(row["methods"]) == {"llm-pq", "pipeedge", "uniform", "adabits"}
    assert row["methods"]["llm-pq"]["omega"] <= row["methods"]["uniform"]["omega"] * (1 + 1e-9)
    assert summarize([row])["vs_uniform"]["cases"] == 1
