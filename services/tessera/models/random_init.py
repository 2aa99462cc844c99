"""`tessera model init-random`: a tiny random-weight checkpoint in Hugging Face format
(config.json + model.safetensors + tokenizer files), fixed seed, for tests and demos.
The tokenizer is the default model's (SmolLM2, 49152 tokens) so chat templates work."""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file

from tessera.config import ConfigError
from tessera.models.default_model import default_tokenizer

_BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, hidden_act="silu", torch_dtype="float32")

CONFIGS = {
    "llama": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "mixtral": dict(_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(_BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                      qkv_bias=True),
    "qwen3_moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                      use_sliding_window=False, attention_bias=False),
}


def random_checkpoint(arch: str, seed: int = 0, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    if arch not in CONFIGS:
        raise ConfigError(f"random:{arch}: no such random architecture (known: {', '.join(sorted(CONFIGS))})")
    cfg = dict(CONFIGS[arch], **overrides)
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731 (std large enough for varied tokens)
    norm = lambda: 1.0 + 0.1 * torch.randn(h, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": norm(),
         "lm_head.weight": rand(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
              p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d)}
        if arch == "qwen2_moe":
            for name in ("q", "k", "v"):
                rows = t[p + f"self_attn.{name}_proj.weight"].shape[0]
                t[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        if arch == "qwen3_moe":
            t[p + "self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
            t[p + "self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        dense = arch == "llama" or i in cfg.get("mlp_only_layers", [])
        t |= _ffn("llama" if dense else arch, cfg, p, rand)
    return cfg, t


def _ffn(arch: str, cfg: dict, p: str, rand) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    if arch == "llama":
        i = cfg["intermediate_size"]
        return {p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i)}
    if arch == "mixtral":
        i, e = cfg["intermediate_size"], cfg["num_local_experts"]
        out = {p + "block_sparse_moe.gate.weight": rand(e, h)}
        for j in range(e):
            q = p + f"block_sparse_moe.experts.{j}."
            out |= {q + "w1.weight": rand(i, h), q + "w3.weight": rand(i, h), q + "w2.weight": rand(h, i)}
        return out
    i, e, s = cfg["moe_intermediate_size"], cfg["num_experts"], cfg.get("shared_expert_intermediate_size", 0)
    out = {p + "mlp.gate.weight": rand(e, h)}
    if s:
        out |= {p + "mlp.shared_expert_gate.weight": rand(1, h),
                p + "mlp.shared_expert.gate_proj.weight": rand(s, h),
                p + "mlp.shared_expert.up_proj.weight": rand(s, h),
                p + "mlp.shared_expert.down_proj.weight": rand(h, s)}
    for j in range(e):
        q = p + f"mlp.experts.{j}."
        out |= {q + "gate_proj.weight": rand(i, h), q + "up_proj.weight": rand(i, h),
                q + "down_proj.weight": rand(h, i)}
    return out


def write_random_model(arch: str, out: str | pathlib.Path, seed: int = 0, shards: int = 1,
                       **overrides) -> pathlib.Path:
    """Write the checkpoint; shards > 1 splits it HF-style with a model.safetensors.index.json."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tensors = random_checkpoint(arch, seed, **overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    names = sorted(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)] if shards > 1 \
        else ["model.safetensors"]
    weight_map = {}
    for k, file in enumerate(files):
        part = names[k::len(files)]
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    default_tokenizer().save_pretrained(str(out))   # not tessera.tokenizer: it resolves models (a cycle)
    return out
