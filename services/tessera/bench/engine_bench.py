"""`tessera bench engine`: offline throughput of the engine (no HTTP, no gRPC), and optionally
transformers' generate on the same weights as the reference, measured in the same run.

Prompts are random token ids of exactly --input-len tokens; every request generates exactly
--output-len tokens (greedy, ignore_eos). Output tokens/s = batch * output_len / wall time;
decode tokens/s counts only the steps after the last request's first token (all decoding),
and roofline_fraction is that rate over the GEMM roofline at this batch (bench/roofline.py).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tessera.bench.roofline import gemm_roofline
from tessera.config import SamplingParams


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Seeded by the batch size: with one seed, a batch's first rows would repeat the previous
    batch's prompts, which the prefix cache would serve."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def run_engine(engine, batch: int, input_len: int, output_len: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = _prompts(batch, input_len, engine.model_config.vocab_size)
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    ids = [engine.add_request(p, sp) for p in prompts]
    start = time.perf_counter()
    first: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
        steps += 1
    wall = time.perf_counter() - start
    ttft = sum(first[i] for i in ids) / len(ids)
    decode_tok_s = batch * (output_len - 1) / (wall - max(first.values()))  # every request decoding
    roof = gemm_roofline(engine.runner.model, batch, engine.dtype)
    return {"impl": "tessera", "batch": batch, "input_len": input_len, "output_len": output_len,
            "dtype": str(engine.dtype).removeprefix("torch."), "wall_s": round(wall, 3), "steps": steps,
            "output_tok_s": round(batch * output_len / wall, 1), "mean_ttft_s": round(ttft, 3),
            "tpot_ms": round((wall - ttft) / max(output_len - 1, 1) * 1000, 2),
            "decode_tok_s": round(decode_tok_s, 1), "gemm_roofline_tok_s": round(roof["roofline_tok_s"], 1),
            "gemm_gflops": round(roof["gemm_gflops"], 1),
            "roofline_fraction": round(decode_tok_s / roof["roofline_tok_s"], 3)}


def hf_dense_model(model_path: str, dtype: str):
    """transformers' model class holding the same dense weights our engine runs (a GGUF is
    dequantized by our reader and loaded by name; transformers would keep it packed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tessera.models.loader import iter_checkpoint, load_config, resolve_model_path
    path = resolve_model_path(model_path)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    c = load_config(path)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict({name: read() for name, read in iter_checkpoint(path)}, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.to(getattr(torch, dtype)).eval()


def run_hf(model_path: str, batch: int, input_len: int, output_len: int, dtype: str) -> dict:
    model = hf_dense_model(model_path, dtype)
    ids = torch.tensor(_prompts(batch, input_len, model.config.vocab_size))
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        wall = time.perf_counter() - start
    return {"impl": "transformers", "batch": batch, "input_len": input_len, "output_len": output_len,
            "dtype": dtype, "wall_s": round(wall, 3), "output_tok_s": round(batch * output_len / wall, 1)}


def main(a: argparse.Namespace) -> int:
    from tessera.config import EngineConfig
    from tessera.engine import Engine
    from tessera.entrypoints.flags import from_args
    engine = Engine(from_args(EngineConfig, a))
    rows = [run_engine(engine, int(b), a.input_len, a.output_len) for b in a.batch_sizes.split(",") if b]
    for b in (x for x in a.hf_reference.split(",") if x):
        rows.append(run_hf(a.model, int(b), a.input_len, a.output_len, a.hf_dtype))
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.engine(a, rows))
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0
