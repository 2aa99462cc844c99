"""Paged attention over a per-layer KV cache laid out [kv_heads, num_blocks * block_size, head_dim].

New K/V are written to their slots first. Decode tokens then attend as one batch: with the
C kernel (tessera_kernels.paged_attention_cpu, float32 or bfloat16 cache) straight from the
paged cache; else
their blocks are gathered whole (one index_select per layer, already [kv_heads, B, L, D] in
this layout) and query heads sharing a KV head are grouped so GQA needs no copy of K/V.
Each prefill chunk attends causally (query heads grouped onto their KV head by SDPA's
enable_gqa, no copy of K/V), to itself alone when it starts at position 0, else to its
gathered context with an offset causal mask; an explicit mask per chunk replaces that
causal one (tree verification: draft tokens attend to the context and their ancestors only).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from tessera.batch import ForwardBatch
from tessera_kernels import paged_attention_cpu


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, scale: float,
                    masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches [KV, S, D]; returns [T, H, D].
    masks[j], when given and not None, is prefill chunk j's bool mask [n, start_pos + n]
    (True: may attend) in place of the causal one; decode tokens attend to their whole context."""
    k_cache.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
    if not batch.prefills:
        return _decode(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    if batch.decode_token_idx.numel():
        out[batch.decode_token_idx] = _decode(q[batch.decode_token_idx], k_cache, v_cache, batch, scale)
    for j, chunk in enumerate(batch.prefills):
        s, n = chunk.token_start, chunk.num_tokens
        mask = chunk.mask if masks is None or masks[j] is None else masks[j]
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)           # [1, H, n, D]
        if chunk.context_slots is None:
            ks, vs = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)
        else:
            ks, vs = k_cache[:, chunk.context_slots], v_cache[:, chunk.context_slots]
        o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=True)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            batch: ForwardBatch, scale: float) -> torch.Tensor:
    """The one place that picks the decode implementation: the C kernel where it applies."""
    if (q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
            and paged_attention_cpu.supports(q.shape[-1]) and paged_attention_cpu.available()):
        return paged_attention_cpu.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens,
            batch.block_size, scale)
    return _decode_gathered(q, k_cache, v_cache, batch, scale)


def _decode_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, scale: float) -> torch.Tensor:
    """One query token per request: softmax(q K^T * scale + mask) V, GQA by grouping heads."""
    B, H, D = q.shape
    KV, S, _ = k_cache.shape
    bs = batch.block_size
    blocks = batch.decode_block_tables.reshape(-1)
    k = k_cache.view(KV, S // bs, bs * D).index_select(1, blocks).view(KV, B, -1, D)
    v = v_cache.view(KV, S // bs, bs * D).index_select(1, blocks).view(KV, B, -1, D)
    qg = q.view(B, KV, H // KV, D).transpose(0, 1)              # [KV, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale      # [KV, B, G, L]
    scores.masked_fill_(~batch.decode_mask[None, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)          # [KV, B, G, D]
    return o.transpose(0, 1).reshape(B, H, D)
