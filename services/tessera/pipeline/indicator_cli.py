"""`tessera indicator`: calibrate, write ω[layer, bits] for `tessera plan pq --indicator`, and
(with --validate) check it against measured perplexity: quantize one layer at a time to
--validate-bits with --group-size, measure held-out perplexity, and report the rank
correlation of every form of ω (indicator.py) with the perplexity increase.

SmolLM2's shipped weights are already Q4_1 with groups of 32, so 4-bit group-32 RTN
reproduces them almost exactly and moves perplexity by noise: validate where quantization
hurts (3 bits, groups of 128, 8-bit never matters much).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

KINDS = ("kl", "variance", "paper")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="omega.json")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--kind", choices=KINDS, default="kl",
                   help="the form written as 'omega' (the one `plan pq` uses); all are written beside it")
    p.add_argument("--windows", type=int, default=8, help="calibration windows of --window-len tokens (statistics)")
    p.add_argument("--kl-windows", type=int, default=4,
                   help="calibration windows the KL form runs (each costs one pass per layer and bit-width)")
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--validate", action="store_true", help="also measure one-layer perplexity increases")
    p.add_argument("--validate-bits", type=int, default=3)
    p.add_argument("--validate-windows", type=int, default=8)
    p.add_argument("--json", action="store_true")


def main(a: argparse.Namespace) -> int:
    from tessera.models.loader import load_model
    from tessera.pipeline import indicator, quality
    from tessera.tokenizer import load_tokenizer
    model, _ = load_model(a.model, torch.float32)
    tok = load_tokenizer(a.model)
    start = time.perf_counter()
    stats = indicator.calibrate(model, quality.windows(tok, "calibration", a.windows, a.window_len))
    forms = {"variance": indicator.omega(stats, group_size=a.group_size), "paper": indicator.omega_paper(stats)}
    meta = {"model": a.model, "calibration_tokens": a.windows * a.window_len,
            "calibration_s": round(time.perf_counter() - start, 2)}
    start = time.perf_counter()
    kl_windows = quality.windows(tok, "calibration", a.kl_windows, a.window_len)
    forms["kl"] = indicator.omega_kl(model, kl_windows, group_size=a.group_size)
    meta.update(kl_tokens=a.kl_windows * a.window_len, kl_s=round(time.perf_counter() - start, 2))
    if a.validate:
        meta["validation"] = validate(model, tok, a, forms)
    indicator.write(a.out, forms, a.kind, a.group_size, meta)
    print(json.dumps(meta, indent=1) if a.json else _summary(meta, a.out))
    return 0


def validate(model, tok, a: argparse.Namespace, forms: dict[str, list[list[float]]]) -> dict:
    from tessera.pipeline import indicator, quality
    held = quality.windows(tok, "heldout", a.validate_windows, a.window_len)
    base = quality.perplexity(model, held)
    ppl = indicator.one_layer_perplexities(model, held, a.validate_bits, a.group_size)
    col = indicator.BITS.index(a.validate_bits)
    delta = [p - base for p in ppl]
    top = lambda v: sorted(range(len(v)), key=v.__getitem__, reverse=True)[:3]   # noqa: E731
    out = {"bits": a.validate_bits, "group_size": a.group_size, "base_perplexity": round(base, 4),
           "delta_perplexity": [round(d, 4) for d in delta], "top3_measured": top(delta)}
    for kind, rows in forms.items():
        scores = [row[col] for row in rows]
        out[f"spearman_{kind}"] = round(indicator.spearman(scores, delta), 3)
        out[f"top3_{kind}"] = top(scores)
    return out


def _summary(meta: dict, out: str) -> str:
    lines = [f"wrote {out} (statistics from {meta['calibration_tokens']} tokens in {meta['calibration_s']} s, "
             f"KL from {meta['kl_tokens']} tokens in {meta['kl_s']} s)"]
    v = meta.get("validation")
    if v:
        lines.append(f"{v['bits']}-bit g{v['group_size']}: base ppl {v['base_perplexity']}, one-layer increases "
                     f"{min(v['delta_perplexity'])}..{max(v['delta_perplexity'])}; most sensitive layers measured "
                     f"{v['top3_measured']}")
        lines += [f"  Spearman(ω_{k}, Δppl) {v[f'spearman_{k}']}, top 3 {v[f'top3_{k}']}" for k in KINDS]
    return "\n".join(lines)
