"""StepPlan -> ForwardBatch: the one place where the scheduler's plain data becomes tensors.

Tokens of all scheduled requests are flattened into one [T] sequence. Attention runs in two
groups: decode requests (one new token each) as one padded batch over their block tables,
and prefill chunks one by one (a chunk that starts at position 0 attends to itself only). A
decode token with a draft tree is a chunk of its own: positions are context + depth, the
mask holds each node's ancestors, and every node's logits are returned (spec/acceptance.py).

The causal rows list every token that attends to exactly the tokens before it and itself
(decode tokens and prompt chunks, not draft trees), each with its request's block table and
its context length, for the paged kernel, which then runs them all in one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.scheduler import StepPlan
from tessera.spec.tree import Draft, lineage


@dataclass
class PrefillChunk:
    token_start: int      # index of the chunk's first token in the flattened batch
    num_tokens: int
    start_pos: int        # position of its first token in the request
    context_slots: torch.Tensor | None  # [start_pos + num_tokens] cache slots, None if start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool causal mask with offset
    in_causal_rows: bool = False  # its tokens are causal rows of the batch (see ForwardBatch)
    # A draft tree's rows for the paged kernel: the cache slots each node attends to (the
    # context, then its ancestors and itself) as a block table of one-slot blocks, padded to W,
    # and how many of them each node attends to
    row_slots: torch.Tensor | None = None  # [num_tokens, W] int64
    row_lens: torch.Tensor | None = None   # [num_tokens] int64


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: where each token's K/V is written
    decode_token_idx: torch.Tensor  # [B] int64: which of the T tokens are decode tokens
    decode_block_tables: torch.Tensor  # [B, W] int64: each decode request's blocks, padded to W
    decode_context_lens: torch.Tensor  # [B] int64
    decode_mask: torch.Tensor      # [B, W * block_size] bool: True where the slot is in the context
    prefills: list[PrefillChunk]
    logits_idx: torch.Tensor       # [S] int64: tokens whose logits are sampled
    block_size: int
    causal_token_idx: torch.Tensor | None = None    # [R] int64 ascending: decode and prompt-chunk tokens
    causal_block_tables: torch.Tensor | None = None  # [R, W'] int64: each row's request's blocks
    causal_context_lens: torch.Tensor | None = None  # [R] int64: tokens each row attends to
    prompt_lens: torch.Tensor | None = None  # [T] int64: each token's request's prompt length (layers/rope.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(plan: StepPlan, block_size: int) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_idx: list[int] = []
    decode_tables: list[tuple[int, ...]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    logits_idx: list[int] = []
    causal_idx: list[int] = []
    causal_lens: list[int] = []
    causal_tables: list[tuple[int, ...]] = []   # one per request, repeated over its rows below
    causal_counts: list[int] = []
    causal_ends: list[int] = []                 # each request's longest row
    prompt_lens: list[int] = []
    for entry in plan.scheduled:
        start = len(input_ids)
        n = len(entry.token_ids)
        input_ids.extend(entry.token_ids)
        # unknown (a plan made by hand): a chunk is taken to end its prompt
        prompt_lens.extend([entry.prompt_len or entry.start_pos + n] * n)
        table = entry.block_table
        for pos in range(entry.start_pos, entry.start_pos + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        if entry.tree_parents:
            draft = Draft(entry.token_ids[1:], entry.tree_parents)
            positions[start:] = [entry.start_pos + d for d in draft.depths()]
            prefills.append(_tree_chunk(start, entry.start_pos, draft, table, block_size))
            logits_idx.extend(range(start, start + n))
            continue
        if n == 1 and entry.start_pos > 0:
            decode_idx.append(start)
            decode_tables.append(table)
            decode_lens.append(entry.start_pos + 1)
        else:
            prefills.append(_prefill_chunk(start, n, entry.start_pos, table, block_size))
        causal_idx.extend(range(start, start + n))
        causal_lens.extend(range(entry.start_pos + 1, entry.start_pos + n + 1))
        causal_tables.append(table)
        causal_counts.append(n)
        causal_ends.append(entry.start_pos + n)
        if entry.sample:
            logits_idx.append(start + n - 1)
    decode_tables_t, decode_mask = _decode_context(decode_tables, decode_lens, block_size)
    request_tables, _ = _decode_context(causal_tables, causal_ends, block_size)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        decode_token_idx=torch.tensor(decode_idx, dtype=torch.long),
        decode_block_tables=decode_tables_t,
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long),
        decode_mask=decode_mask,
        prefills=prefills,
        logits_idx=torch.tensor(logits_idx, dtype=torch.long),
        block_size=block_size,
        causal_token_idx=torch.tensor(causal_idx, dtype=torch.long),
        causal_block_tables=request_tables.repeat_interleave(torch.tensor(causal_counts, dtype=torch.long), dim=0),
        causal_context_lens=torch.tensor(causal_lens, dtype=torch.long),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
    )


def _slots(table: tuple[int, ...], num_blocks: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table[:num_blocks], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def _prefill_chunk(start: int, n: int, start_pos: int, table: tuple[int, ...],
                   block_size: int) -> PrefillChunk:
    if start_pos == 0:
        return PrefillChunk(start, n, 0, None, None, in_causal_rows=True)
    length = start_pos + n
    slots = _slots(table, -(-length // block_size), block_size)[:length]
    mask = torch.arange(length)[None, :] <= torch.arange(start_pos, length)[:, None]
    return PrefillChunk(start, n, start_pos, slots, mask, in_causal_rows=True)


def _tree_chunk(start: int, start_pos: int, draft: Draft, table: tuple[int, ...],
                block_size: int) -> PrefillChunk:
    """A draft tree after the decode token (its root): stored in slots start_pos.. in node
    order, each node attending to the context and to its ancestors (itself included)."""
    n = len(draft) + 1
    length = start_pos + n
    slots = _slots(table, -(-length // block_size), block_size)[:length]
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, :start_pos] = True
    parents = (-1,) + draft.parents
    lineages = [[start_pos + a for a in lineage(parents, i)] for i in range(n)]
    row_slots = torch.zeros(n, start_pos + max(map(len, lineages)), dtype=torch.long)
    row_slots[:, :start_pos] = slots[:start_pos]
    for i, line in enumerate(lineages):
        mask[i, line] = True
        row_slots[i, start_pos:start_pos + len(line)] = slots[line]
    row_lens = torch.tensor([start_pos + len(line) for line in lineages], dtype=torch.long)
    return PrefillChunk(start, n, start_pos, slots, mask, row_slots=row_slots, row_lens=row_lens)


def _decode_context(tables: list[tuple[int, ...]], lens: list[int],
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every decode request's block list to the longest one; the mask hides the padding."""
    width = max((-(-n // block_size) for n in lens), default=0)
    padded = [list(t[:width]) + [0] * (width - min(len(t), width)) for t in tables]
    lens_t = torch.tensor(lens, dtype=torch.long)
    mask = torch.arange(width * block_size)[None, :] < lens_t[:, None]
    return torch.tensor(padded, dtype=torch.long).reshape(len(tables), width), mask
