"""Paged attention over a flat per-layer KV cache of shape [num_slots, kv_heads, head_dim].

New K/V are written to their slots first; then decode tokens attend as one padded batch over
their gathered context, and each prefill chunk attends causally (to itself alone when it
starts at position 0, else to its gathered context with an offset causal mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.batch import ForwardBatch


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; returns [T, H, D]."""
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    if batch.decode_token_idx.numel():
        qd = q[batch.decode_token_idx].unsqueeze(2)            # [B, H, 1, D]
        kd = k_cache[batch.decode_slots].transpose(1, 2)       # [B, KV, L, D]
        vd = v_cache[batch.decode_slots].transpose(1, 2)
        od = _sdpa(qd, kd, vd, batch.decode_mask, scale)
        out[batch.decode_token_idx] = od.squeeze(2)
    for chunk in batch.prefills:
        s, n = chunk.token_start, chunk.num_tokens
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)           # [1, H, n, D]
        if chunk.context_slots is None:
            ks, vs, mask = k[s:s + n], v[s:s + n], None
        else:
            ks, vs = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            mask = chunk.mask
        o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask,
                  scale, causal=mask is None)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
