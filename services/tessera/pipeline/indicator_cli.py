"""`tessera indicator`: calibrate, write ω[layer, bits] for `tessera plan pq --indicator`, and
(with --validate) check it against measured perplexity: quantize one layer at a time to
--validate-bits with --group-size, measure held-out perplexity, and report the rank
correlation of ω with the perplexity increase (ours and the paper's form).

SmolLM2's shipped weights are already Q4_1 with groups of 32, so 4-bit group-32 RTN
reproduces them almost exactly and moves perplexity by noise: validate where quantization
hurts (3 bits, groups of 128, 8-bit never matters much).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="omega.json")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--windows", type=int, default=8, help="calibration windows of --window-len tokens")
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--validate", action="store_true", help="also measure one-layer perplexity increases")
    p.add_argument("--validate-bits", type=int, default=3)
    p.add_argument("--validate-windows", type=int, default=4)
    p.add_argument("--json", action="store_true")


def main(a: argparse.Namespace) -> int:
    from tessera.models.loader import load_model
    from tessera.pipeline import indicator, quality
    from tessera.tokenizer import load_tokenizer
    model, _ = load_model(a.model, torch.float32)
    tok = load_tokenizer(a.model)
    start = time.perf_counter()
    stats = indicator.calibrate(model, quality.windows(tok, "calibration", a.windows, a.window_len))
    ours, paper = indicator.omega(stats, group_size=a.group_size), indicator.omega_paper(stats)
    meta = {"model": a.model, "calibration_tokens": a.windows * a.window_len,
            "calibration_s": round(time.perf_counter() - start, 2)}
    if a.validate:
        meta["validation"] = validate(model, tok, a, stats)
    indicator.write(a.out, ours, paper, a.group_size, meta)
    print(json.dumps(meta, indent=1) if a.json else _summary(meta, a.out))
    return 0


def validate(model, tok, a: argparse.Namespace, stats) -> dict:
    from tessera.pipeline import indicator, quality
    held = quality.windows(tok, "heldout", a.validate_windows, a.window_len)
    base = quality.perplexity(model, held)
    ppl = indicator.one_layer_perplexities(model, held, a.validate_bits, a.group_size)
    col = indicator.BITS.index(a.validate_bits)
    ours = [row[col] for row in indicator.omega(stats, group_size=a.group_size)]
    paper = [row[col] for row in indicator.omega_paper(stats)]
    delta = [p - base for p in ppl]
    top = lambda v: sorted(range(len(v)), key=v.__getitem__, reverse=True)[:3]   # noqa: E731
    return {"bits": a.validate_bits, "group_size": a.group_size, "base_perplexity": round(base, 4),
            "top3_measured": top(delta), "top3_omega": top(ours), "top3_omega_paper": top(paper),
            "delta_perplexity": [round(d, 4) for d in delta],
            "spearman_omega": round(indicator.spearman(ours, delta), 3),
            "spearman_omega_paper": round(indicator.spearman(paper, delta), 3)}


def _summary(meta: dict, out: str) -> str:
    lines = [f"wrote {out} (calibrated on {meta['calibration_tokens']} tokens in {meta['calibration_s']} s)"]
    v = meta.get("validation")
    if v:
        lines.append(f"{v['bits']}-bit g{v['group_size']}: base ppl {v['base_perplexity']}, one-layer increases "
                     f"{min(v['delta_perplexity'])}..{max(v['delta_perplexity'])}; Spearman(ω, Δppl) "
                     f"{v['spearman_omega']} (paper's form {v['spearman_omega_paper']}); most sensitive layers "
                     f"measured {v['top3_measured']}, by ω {v['top3_omega']}, by the paper's form {v['top3_omega_paper']}")
    return "\n".join(lines)
