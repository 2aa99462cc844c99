"""Llama family (Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3, SmolLM2): a decoder layer is
    h   = x + attention(rms_norm(x))
    out = h + ffn(rms_norm(h))
The attention half and the FFN half are separate modules so that an attention node and an
expert node can each build only theirs; MoE models (mixtral.py, qwen_moe.py) reuse this file
and swap the FFN half. The FFN half is three steps, so that its middle can run elsewhere:
    ffn_in = prepare(h)                  norm (and, for MoE, the router's choice)
    y      = compute(ffn_in)             the MLP or experts: a node may hold a share of them
    out    = finish(h, ffn_in, y)        h + y (+ the gated shared expert)
models/driver.py composes these pieces into layers; this file only defines them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from tessera.batch import ForwardBatch
from tessera.config import ConfigError
from tessera.layers.attention import paged_attention
from tessera.layers.linear import Linear
from tessera.layers.mlp import SwiGLU
from tessera.layers.norm import RMSNorm
from tessera.layers.residual import residual_add
from tessera.layers.rope import RotaryEmbedding, apply_rope
from tessera.models.model_config import ModelConfig


class LlamaAttention(nn.Module):
    """The attention half: norm, fused QKV, RoPE, paged attention, output projection.
    Granite's constants: the query scale (attention_multiplier) and the factor on the output
    before the residual add (residual_multiplier)."""
    batch_invariant = False   # the batch-invariant mode (tessera/batch_invariant.py) sets it

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_rows, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.query_scale or cfg.head_dim ** -0.5
        self.residual_multiplier = cfg.residual_multiplier
        self.window, self.softcap = cfg.window(layer), cfg.attn_softcap

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor],
                masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """rope: cos, sin of each token's position; masks: see paged_attention."""
        return self.attend(*self.project(x), batch, kv, rope, masks)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query and key heads side by side [T, H + KV, D], value heads [T, KV, D])."""
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.norm(x))
        qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)      # query and key heads, rotated together
        v = qkv[:, (H + KV) * D:].view(T, KV, D)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        return qk, v

    def attend(self, qk: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               kv: tuple[torch.Tensor, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
               masks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
        """RoPE, paged attention, output projection."""
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        o = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale, masks, window=self.window, softcap=self.softcap,
                            invariant=self.batch_invariant)
        out = self.o_proj(o.reshape(q.shape[0], -1))
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


@dataclass
class FFNInput:
    """What an FFN's compute needs, made by its prepare: the normalized hidden states [T, H]
    and, for a routed FFN, each token's top-k expert ids [T, k] and gate weights [T, k]."""
    x: torch.Tensor
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None


class LlamaFFN(nn.Module):
    """The dense FFN half: norm, then SwiGLU. An expert node holds a column range of the MLP
    (shard(columns=...)); the partial outputs of all ranges sum to the whole."""
    top_k = 0   # tokens are not routed: every node that holds a share sees every token

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.residual_multiplier = cfg.residual_multiplier

    def prepare(self, h: torch.Tensor) -> FFNInput:
        return FFNInput(self.norm(h))

    def compute(self, ffn_in: FFNInput) -> torch.Tensor:
        return self.mlp(ffn_in.x)

    def finish(self, h: torch.Tensor, ffn_in: FFNInput, y: torch.Tensor) -> torch.Tensor:
        return residual_add(h, y if self.residual_multiplier == 1.0 else y * self.residual_multiplier)

    def shard(self, experts: Sequence[int] | None = None, columns: tuple[int, int] | None = None) -> None:
        """Keep intermediate columns [i0, i1) of the MLP (after loading: the checkpoint holds
        whole matrices); `experts` concerns routed FFNs only."""
        if columns is not None:
            self.mlp = self.mlp.columns(*columns)

    def drop_compute(self) -> None:
        """An attention node: the MLP lives on the expert nodes."""
        self.mlp = None

    def drop_ends(self) -> None:
        """An expert node: prepare and finish run on the attention node."""
        self.norm = None


class DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.ffn = ffn


FFNFactory = Callable[[ModelConfig, int], nn.Module]
AttentionFactory = Callable[[ModelConfig, int], nn.Module]


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant (Granite's embedding_multiplier; 1: plain lookup)."""

    def __init__(self, vocab: int, hidden: int, scale: float) -> None:
        super().__init__(vocab, hidden)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        return x if self.scale == 1.0 else x * self.scale


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head. The pieces models/driver.py composes:
    embed_tokens(ids), rope(positions, dtype), layers[l].attn(x, batch, kv, rope, masks),
    layers[l].ffn.prepare / compute / finish, norm(x), compute_logits(hidden)."""

    def __init__(self, cfg: ModelConfig, make_ffn: FFNFactory = LlamaFFN,
                 make_attn: AttentionFactory = LlamaAttention) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embedding_multiplier)
        self.layers = nn.ModuleList(
            DecoderLayer(make_attn(cfg, i), make_ffn(cfg, i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    dict(cfg.rope_scaling))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, cfg = self.lm_head(hidden), self.config
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits.float()

    def drop_ffn_compute(self) -> None:
        """What an AFD attention node holds: everything but each FFN's MLP or experts."""
        for layer in self.layers:
            layer.ffn.drop_compute()

    def keep_ffn_compute(self, experts: Sequence[int] | None = None) -> None:
        """What an AFD expert node holds: each FFN's compute only, and of a routed FFN only
        `experts`. Called before loading, so the other tensors are never read."""
        self.embed_tokens = self.norm = self.lm_head = None
        for layer in self.layers:
            layer.attn = None
            layer.ffn.drop_ends()
            layer.ffn.shard(experts=experts)

    def keep_layers(self, layers: range) -> None:
        """What a pipeline stage holds: decoder layers `layers` (a contiguous range), the
        embedding on the first stage, the final norm and LM head on the last (which, with tied
        embeddings, keeps the embedding: it is the head's weight). Called before loading, so
        the other tensors are never read. Indices stay the whole model's: layers[l] is layer
        l, and a layer not held is left empty."""
        n = len(self.layers)
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= n:
            raise ValueError(f"layers {layers.start}:{layers.stop} is not a range within the model's {n} layers")
        first, last = layers.start == 0, layers.stop == n
        for l, layer in enumerate(self.layers):
            if l not in layers:
                layer.attn = layer.ffn = None
        if not last:
            self.norm = self.lm_head = None
        if not first and not (last and self.config.tie_word_embeddings):
            self.embed_tokens = None

    def weight_rules(self) -> list[Rule]:
        """How HF tensor names map onto our parameters (see match_rules)."""
        return _llama_rules(self.config) + _ffn_rules(self.config)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.named_parameters(remove_duplicate=False)}


View = Callable[[torch.Tensor, re.Match], torch.Tensor | None]
Rule = tuple[str, str, View | None]


def rows(start: int, size: int) -> View:
    return lambda p, m: p.narrow(0, start, size)


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = r"model\.layers\.(\d+)\."
    return [
        (r"model\.embed_tokens\.weight", "embed_tokens.weight", None),
        (r"model\.norm\.weight", "norm.weight", None),
        (r"lm_head\.weight", "lm_head.weight", None),
        (layer + r"input_layernorm\.weight", r"layers.\1.attn.norm.weight", None),
        (layer + r"self_attn\.q_proj\.(weight|bias)", r"layers.\1.attn.qkv_proj.\2", rows(0, q)),
        (layer + r"self_attn\.k_proj\.(weight|bias)", r"layers.\1.attn.qkv_proj.\2", rows(q, kv)),
        (layer + r"self_attn\.v_proj\.(weight|bias)", r"layers.\1.attn.qkv_proj.\2",
         rows(q + kv, kv)),
        (layer + r"self_attn\.qkv_proj\.(weight|bias)", r"layers.\1.attn.qkv_proj.\2", None),   # Phi-3: fused
        (layer + r"self_attn\.o_proj\.(weight|bias)", r"layers.\1.attn.o_proj.\2", None),
        (layer + r"self_attn\.(q_norm|k_norm)\.weight", r"layers.\1.attn.\2.weight", None),
        (layer + r"post_attention_layernorm\.weight", r"layers.\1.ffn.norm.weight", None),
    ]


def _ffn_rules(cfg: ModelConfig) -> list[Rule]:
    return [(r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", r"layers.\1.ffn.mlp.gate_up_proj.weight", None),
            *swiglu_rules(r"model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn.mlp.", cfg.intermediate_size)]


def swiglu_rules(src: str, dst: str, i: int) -> list[Rule]:
    """HF gate_proj/up_proj/down_proj into our fused gate_up_proj and down_proj."""
    return [
        (src + r"gate_proj\.weight", dst + "gate_up_proj.weight", rows(0, i)),
        (src + r"up_proj\.weight", dst + "gate_up_proj.weight", rows(i, i)),
        (src + r"down_proj\.weight", dst + "down_proj.weight", None),
    ]


def match_rules(params: dict[str, torch.Tensor], name: str, rules: list[Rule]
                ) -> tuple[str, torch.Tensor] | None:
    """(our parameter name, the view to copy into) for HF tensor `name`; None: not held here."""
    for pattern, target, view in rules:
        m = re.fullmatch(pattern, name)
        if m is None:
            continue
        param_name = m.expand(target)
        param = params.get(param_name)
        if param is None:
            return None
        dest = param if view is None else view(param, m)
        return None if dest is None else (param_name, dest)
    raise ConfigError(f"unexpected tensor {name} in the checkpoint (a variant of the architecture "
                      "that Tessera does not implement)")
