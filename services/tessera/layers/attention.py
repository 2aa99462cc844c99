"""Paged attention over a per-layer KV cache laid out [kv_heads, num_blocks * block_size, head_dim].

New K/V are written to their slots first. With the C kernel (tessera_kernels.paged_attention_cpu,
float32 or bfloat16 cache), every token that attends causally, decode and prompt alike, is a
row of one kernel call straight from the paged cache: a prompt token is a query whose context
ends at itself (ForwardBatch's causal rows; the kernel takes a chunk's rows 16 at a time). On
CPUs without AMX the kernel, with its prompt tiles, is faster than torch's SDPA for prompts of
every length. Where the CPU has AMX, SDPA's flash attention runs its products on AMX and wins
for long prompts, so there bf16 prompt chunks that start at position 0 go to SDPA in steps of
more than PROMPTS_ON_KERNEL_UP_TO tokens (prompts_by_sdpa); decode rows stay on the kernel, and
so do prompt chunks whose rows attend to at most CHUNK_CONTEXT_ON_KERNEL_UP_TO tokens (below).
A longer chunk after cached tokens (a prefix hit, the next chunk of a long prompt) goes to SDPA
there too, attending to its gathered context with an offset causal mask. The measurements
behind these thresholds are in docs/performance-notes.md.
Without the kernel, decode tokens attend as one batch whose blocks are gathered whole (one
index_select per layer, already [kv_heads, B, L, D] in this layout), query heads sharing a KV head
grouped so GQA needs no copy of K/V; each prefill chunk attends causally through SDPA (enable_gqa,
no copy of K/V), to itself alone when it starts at position 0, else to its gathered context with an
offset causal mask. A draft tree's nodes (tree verification: each attends to the context and its
ancestors only) are rows of the kernel too, each with its own list of slots as a table of one-slot
blocks. Each row reads the context again (from cache: one layer's is a few MB), and still a
verification step is faster this way than through SDPA with a gathered context and an explicit
mask. The draft model's expansions (spec/drafter.py) pass their rows' slots the same way; a chunk
given an explicit mask takes SDPA.
An int8 cache (--kv-cache-dtype int8, tessera_kernels.kv_int8: rows of int8 values and their
scale) is written quantized, and its kernel rows go to the int8 kernel (one row at a time: no
prompt tiles, so in steps of more than PROMPTS_ON_KERNEL_UP_TO tokens the long prompt chunks
take SDPA on every CPU, as on AMX). Every other path reads the rows it needs dequantized to q's dtype (_cache_rows,
_gather_blocks): correct, at the cost of a copy; a fresh prompt's SDPA call attends to its own
unquantized K/V, as before.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Sequence

import torch
import torch.nn.functional as F

from tessera.batch import ForwardBatch, PrefillChunk
from tessera_kernels import cbuild, kv_int8, paged_attention_cpu

log = logging.getLogger(__name__)

# A step of at most this many tokens keeps its prompt chunks on the kernel even where SDPA
# takes them (AMX): the kernel is about as fast for short prompts (SDPA pulls ahead only for
# longer ones), and a step whose every call is a C kernel's can be recorded and replayed
# (step_graph.py: steps of up to this many tokens).
PROMPTS_ON_KERNEL_UP_TO = 256

# In a larger step where SDPA takes prompts, a prompt chunk whose rows attend to at most this
# many tokens stays on the kernel, in its one call with the decode rows: SDPA batches only
# fresh prompts of equal length into one call, and a step of prompts of varied length makes one
# SDPA call per prompt. Alone, one short prompt's SDPA call is a little faster than the kernel
# (bench/prompt_attention.py), but in a step of many prompts of varied length the kernel's one
# call wins, and with prompts of one length the two are even (bench/prefill_steps.py). Longer
# chunks keep SDPA's flash attention, which is well ahead from a few hundred tokens on. Only 256
# and 0 (every chunk on SDPA) have been compared.
CHUNK_CONTEXT_ON_KERNEL_UP_TO = 256


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, scale: float,
                    masks: Sequence[torch.Tensor | None] | None = None, *,
                    window: int = 0, softcap: float = 0.0, invariant: bool = False) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches [KV, S, D]; returns [T, H, D].
    masks[j], when given and not None, is prefill chunk j's bool mask [n, start_pos + n]
    (True: may attend) in place of the causal one; decode tokens attend to their whole context.
    window > 0: each query sees only the last `window` keys it may attend to (a sliding
    window: its own position and the window - 1 before it; a mask row's True columns are taken
    as positions 0..p in order). softcap > 0: scores = softcap * tanh(scale * q.k / softcap).
    invariant (the batch-invariant mode, tessera/batch_invariant.py): every row, prompt and tree
    rows included, goes alone through the kernel's one-row path, as a decode row does, so its
    bits do not depend on the rows beside it; no SDPA, no prompt tiles. Explicit masks (a
    drafter's expansions) still take SDPA: they decide drafts, never the tokens emitted."""
    int8 = k_cache.dtype == torch.int8
    (kv_int8 if int8 else paged_attention_cpu).kv_write(k, v, k_cache, v_cache, batch.slot_mapping)
    attend_rows = kv_int8.paged_decode_attention_int8 if int8 else paged_attention_cpu.paged_decode_attention
    capped = window > 0 or softcap > 0
    kernel = (_int8_kernel_applies(q, k_cache) if int8 else _kernel_applies(q)) and (
        not capped or _kernel_takes(window, softcap))
    capping = {"window": window, "softcap": softcap} if capped else {}   # other models: the call as it was
    if invariant:
        if not kernel:
            raise RuntimeError("the batch-invariant mode needs the paged attention kernel (batch_invariant.apply checks)")
        capping["tiles"] = False
    by_kernel = kernel and masks is None and batch.causal_token_idx is not None
    # the int8 kernel has no prompt tiles: there long prompt chunks go to SDPA on every CPU
    long_by_sdpa = by_kernel and not capped and not invariant and (
        prompts_by_sdpa(q) or int8 and q.shape[0] > PROMPTS_ON_KERNEL_UP_TO)
    to_sdpa = [c for c in batch.prefills if long_by_sdpa and _sdpa_takes(c)]
    if by_kernel:
        rows, tables, lens = _kernel_rows(batch, to_sdpa)
    else:
        rows, tables, lens = batch.decode_token_idx, batch.decode_block_tables, batch.decode_context_lens
    out = torch.empty_like(q) if rows.numel() < q.shape[0] else None
    if rows.numel():
        qr = q if out is None else q[rows]      # rows ascend: all of them is every token
        res = (attend_rows(qr, k_cache, v_cache, tables, lens, batch.block_size, scale, **capping)
               if kernel else _decode_gathered(qr, k_cache, v_cache, batch, scale, window, softcap))
        if out is None:
            return res
        out[rows] = res
    todo = [j for j, chunk in enumerate(batch.prefills)
            if not (by_kernel and chunk.in_causal_rows) or (long_by_sdpa and _sdpa_takes(chunk))]
    while todo:
        j = todo.pop(0)
        chunk = batch.prefills[j]
        s, n = chunk.token_start, chunk.num_tokens
        if kernel and chunk.row_slots is not None and (masks is None or masks[j] is None):
            slots = chunk.row_slots if window <= 0 else _slots_in_position_order(chunk)
            out[s:s + n] = attend_rows(q[s:s + n], k_cache, v_cache, slots, chunk.row_lens, 1, scale, **capping)
            continue
        mask = chunk.mask if masks is None or masks[j] is None else masks[j]
        if capped:
            out[s:s + n] = _chunk_capped(q, k, v, k_cache, v_cache, chunk, mask, scale, window, softcap)
            continue
        if chunk.context_slots is None and mask is None:
            # Fresh prompts of this length right after this one join its SDPA call as a batch:
            # one call for all of them is faster than one per prompt, with the same bits.
            b = 1
            while todo and _fresh_and_next(batch.prefills[todo[0]], s + b * n, n, masks, todo[0]):
                todo.pop(0)
                b += 1
            out[s:s + b * n] = _causal_sdpa(q[s:s + b * n], k[s:s + b * n], v[s:s + b * n], b, scale)
            continue
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)           # [1, H, n, D]
        if chunk.context_slots is None:
            ks, vs = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)
        else:
            ks, vs = _cache_rows(k_cache, chunk.context_slots, q.dtype), _cache_rows(v_cache, chunk.context_slots, q.dtype)
        o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=True)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _fresh_and_next(chunk, start: int, n: int, masks, j: int) -> bool:
    """Whether `chunk` is a fresh prompt chunk of n tokens starting at token `start`, with no
    mask of its own (it may join the SDPA batch before it)."""
    return (chunk.token_start == start and chunk.num_tokens == n and chunk.context_slots is None
            and chunk.mask is None and chunk.row_slots is None and (masks is None or masks[j] is None))


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, scale: float) -> torch.Tensor:
    """b prompts of equal length, back to back in q [b*n, H, D], k and v [b*n, KV, D], each
    attending causally to itself: one SDPA call over [b, heads, n, D] views (no copies)."""
    T, H, D = q.shape
    n = T // b
    o = F.scaled_dot_product_attention(q.view(b, n, H, D).transpose(1, 2), k.view(b, n, -1, D).transpose(1, 2),
                                       v.view(b, n, -1, D).transpose(1, 2), is_causal=True, scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(T, H, D)


def _kernel_applies(q: torch.Tensor) -> bool:
    """Whether the C kernel applies at all (prompts_by_sdpa then decides, on AMX, where
    prompt chunks go)."""
    return (q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
            and paged_attention_cpu.supports(q.shape[-1]) and paged_attention_cpu.available())


def prompts_by_sdpa(q: torch.Tensor) -> bool:
    """Whether a step's long prompt chunks (_sdpa_takes; q: all of the step's tokens) attend
    through SDPA although the kernel applies: bf16 where the CPU has AMX, in steps of more than
    PROMPTS_ON_KERNEL_UP_TO tokens (see the module docstring; TESSERA_PROMPTS_BY_KERNEL=1 keeps
    them all on the kernel there, to compare the two)."""
    return q.dtype == torch.bfloat16 and q.shape[0] > PROMPTS_ON_KERNEL_UP_TO and _amx_prompts_by_sdpa()


@functools.cache   # read once per process: every layer of every step asks
def _amx_prompts_by_sdpa() -> bool:
    return "amx_bf16" in cbuild.cpu_flags() and os.environ.get("TESSERA_PROMPTS_BY_KERNEL") != "1"


def _sdpa_takes(chunk: PrefillChunk) -> bool:
    """A prompt chunk among the causal rows whose last row attends to more than
    CHUNK_CONTEXT_ON_KERNEL_UP_TO tokens: in a step where prompts_by_sdpa, SDPA takes it."""
    return chunk.in_causal_rows and chunk.start_pos + chunk.num_tokens > CHUNK_CONTEXT_ON_KERNEL_UP_TO


def _kernel_rows(batch: ForwardBatch,
                 to_sdpa: list[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal rows the kernel takes (tokens, block tables, context lengths): all of them,
    less the tokens of the chunks SDPA takes (only in eager steps: a replayed one has none)."""
    if not to_sdpa:
        return batch.causal_token_idx, batch.causal_block_tables, batch.causal_context_lens
    dropped = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for c in to_sdpa:
        dropped[c.token_start:c.token_start + c.num_tokens] = True
    keep = ~dropped[batch.causal_token_idx]
    return batch.causal_token_idx[keep], batch.causal_block_tables[keep], batch.causal_context_lens[keep]


def _decode_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query token per request: softmax(q K^T * scale + mask) V, GQA by grouping heads
    (a window narrows the mask, softcap caps the scores: see paged_attention)."""
    B, H, D = q.shape
    KV = k_cache.shape[0]
    blocks = batch.decode_block_tables.reshape(-1)
    k = _gather_blocks(k_cache, blocks, batch.block_size, B, q.dtype)
    v = _gather_blocks(v_cache, blocks, batch.block_size, B, q.dtype)
    qg = q.view(B, KV, H // KV, D).transpose(0, 1)              # [KV, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale      # [KV, B, G, L]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _window(batch.decode_mask, window) if window > 0 else batch.decode_mask
    scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)          # [KV, B, G, D]
    return o.transpose(0, 1).reshape(B, H, D)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, bs: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """The cache's blocks [B * W] whole, as [KV, B, W * bs, D] (one index_select); an int8
    cache's dequantized to dtype."""
    KV, S, R = cache.shape
    rows = cache.view(KV, S // bs, bs * R).index_select(1, blocks).view(KV, B, -1, R)
    return kv_int8.dequantize(rows, dtype) if cache.dtype == torch.int8 else rows


def _cache_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[:, slots] ([KV, ..., D]); an int8 cache's dequantized to dtype."""
    rows = cache[:, slots]
    return kv_int8.dequantize(rows, dtype) if cache.dtype == torch.int8 else rows


def _int8_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the int8 kernel takes an int8 cache's rows; where not (no compiler, a head size
    it lacks), every row reads dequantized blocks (logged once)."""
    if kv_int8.applies(q, k_cache):
        return True
    _log_once("int8 KV cache without its kernel (unbuilt or head size): attention reads dequantized blocks")
    return False


def _slots_in_position_order(chunk: PrefillChunk) -> torch.Tensor:
    """A draft tree's row slots with each row's keys in position order (its mask's True
    columns ascending: the context, then the ancestors root first), as the kernel's window
    takes them: row_slots may list the ancestors in another order (any order serves without
    a window)."""
    order = torch.argsort((~chunk.mask).to(torch.int8), dim=1, stable=True)[:, :chunk.row_slots.shape[1]]
    return chunk.context_slots[order]


def _window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """mask [..., L] (True: may attend) keeping each row's last `window` True columns: a row's
    keys are its positions 0..p in order, so these are p - window < k <= p."""
    rank = mask.cumsum(-1)
    return mask & (rank > mask.sum(-1, keepdim=True) - window)


def _chunk_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  chunk: PrefillChunk, mask: torch.Tensor | None, scale: float, window: int,
                  softcap: float) -> torch.Tensor:
    """A prefill chunk's [n, H, D] attention where a window or soft-capping applies: its own
    K/V (a fresh prompt) or its gathered context, under its mask (causal if None) narrowed to
    the window; SDPA takes it unless it soft-caps (SDPA cannot: explicit scores then)."""
    s, n = chunk.token_start, chunk.num_tokens
    if chunk.context_slots is None:
        ks, vs = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)
    else:
        ks, vs = _cache_rows(k_cache, chunk.context_slots, q.dtype), _cache_rows(v_cache, chunk.context_slots, q.dtype)
    if mask is None:
        L = ks.shape[1]
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    if window > 0:
        mask = _window(mask, window)
    if softcap > 0:
        _log_once("soft-capped prompt chunks attend through explicit scores and softmax (SDPA cannot soft-cap)")
        return _attend_explicit(q[s:s + n], ks, vs, mask, scale, softcap)
    o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1).unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float) -> torch.Tensor:
    """q [n, H, D]; k, v [KV, L, D]; mask [n, L]: softmax(softcap * tanh(scale q.k / softcap))
    V in float32 (the kernel's arithmetic), GQA by grouping heads, in q's dtype."""
    n, H, D = q.shape
    KV = k.shape[0]
    qg = q.float().view(n, KV, H // KV, D).permute(1, 2, 0, 3)          # [KV, G, n, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2).unsqueeze(1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~mask, float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v.float().unsqueeze(1))   # [KV, G, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, H, D).to(q.dtype)


def _kernel_takes(window: int, softcap: float) -> bool:
    """Whether the C kernel computes this window and soft-capping itself: it does (its prompt
    tiles do not yet: such rows go one at a time, logged once)."""
    _log_once("window or soft-capping: the paged attention kernel takes prompt rows one at a time (not in tiles)")
    return True


@functools.cache   # once per process per case
def _log_once(message: str) -> None:
    log.info(message)
