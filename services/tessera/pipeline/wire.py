"""What one pipeline stage sends the next for one micro-batch: the micro-batch's plan (so the
next stage builds the same ForwardBatch: positions, KV slots from the block tables, masks) and
its hidden states, as one uint8 message on the M2N transport:

    int64 words   MAGIC, m, entries E, tokens T, hidden H, dtype code,
                  the trace context (tracing_detail.WORDS words: the sender's transfer span, or zeros),
                  per entry: tokens, start_pos, sample, block table length, tree length, prompt length,
                  then every entry's token ids, then block tables, then tree parents
    then          the hidden states [T, H] in the model's dtype

m is the step's micro-batch count: a stage learns from micro-batch 0 how many follow. The
last stage answers stage 0 with plain float32 logits [S, vocab]. A malformed message raises
TransportError (the receiving stage rejects it and keeps serving).
"""
from __future__ import annotations

import torch

from tessera import tracing_detail
from tessera.scheduler import ScheduledRequest, StepPlan
from tessera.transport.base import DTYPE_CODES, DTYPES, TransportError

MAGIC = 0x5450_4951   # "PIPT" + 1: the header with the trace context (an older stage's is refused, not misread)
FIXED = 6             # the header's words before the trace context
HEAD, PER_ENTRY = FIXED + tracing_detail.WORDS, 6


def encode_step(plan: StepPlan, hidden: torch.Tensor, micro_batches: int,
                context: tuple[int, ...] = tracing_detail.NONE) -> torch.Tensor:
    entries = plan.scheduled
    words = [MAGIC, micro_batches, len(entries), hidden.shape[0], hidden.shape[1], DTYPE_CODES[hidden.dtype],
             *context]
    for e in entries:
        words += [len(e.token_ids), e.start_pos, int(e.sample), len(e.block_table), len(e.tree_parents), e.prompt_len]
    for field in ("token_ids", "block_table", "tree_parents"):
        for e in entries:
            words.extend(getattr(e, field))
    head = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, hidden.contiguous().view(-1).view(torch.uint8)])


def decode_step(message: torch.Tensor, hidden_size: int, dtype: torch.dtype,
                num_blocks: int) -> tuple[int, StepPlan, torch.Tensor]:
    """(m, the micro-batch's plan, its hidden states: a view into `message`). Checks the
    framing, that the hidden states are [T, hidden_size] in `dtype`, and that every block id
    is one of this stage's num_blocks."""
    if message.dtype != torch.uint8 or message.dim() != 1 or message.numel() < 8 * HEAD:
        raise TransportError("pipeline message: not a framed uint8 message")
    words = message[:8 * FIXED].view(torch.int64).tolist()
    magic, m, n, tokens, hidden, code = words
    if magic != MAGIC or m < 1 or n < 0 or tokens < 0 or not 0 <= n * PER_ENTRY <= message.numel() // 8:
        raise TransportError(f"pipeline message: bad header {words}")
    if hidden != hidden_size or DTYPES.get(code) != dtype:
        raise TransportError(f"pipeline message: hidden states [{hidden}] {DTYPES.get(code)}, this stage "
                             f"runs [{hidden_size}] {dtype}")
    per = message[8 * HEAD:8 * (HEAD + n * PER_ENTRY)].view(torch.int64).view(n, PER_ENTRY).tolist()
    lengths = [sum(p[k] for p in per) for k in (0, 3, 4)]
    if lengths[0] != tokens or min((x for p in per for x in p), default=0) < 0:
        raise TransportError("pipeline message: entry lengths do not add up")
    start = 8 * (HEAD + n * PER_ENTRY)
    body_end = start + 8 * sum(lengths)
    if message.numel() != body_end + tokens * hidden * torch.empty((), dtype=dtype).element_size():
        raise TransportError(f"pipeline message: {message.numel()} bytes do not match its header")
    body = message[start:body_end].view(torch.int64).tolist()
    plan = StepPlan(tuple(_entries(per, body, lengths)))
    if any(not 0 <= b < num_blocks for e in plan.scheduled for b in e.block_table):
        raise TransportError(f"pipeline message: a block id outside this stage's {num_blocks} blocks")
    x = message[body_end:].view(dtype).view(tokens, hidden)
    return m, plan, x


def trace_context(message: torch.Tensor) -> tuple[int, ...]:
    """The trace context of a message decode_step accepted (tracing_detail.NONE: none)."""
    return tuple(message[8 * FIXED:8 * HEAD].view(torch.int64).tolist())


def _entries(per: list[list[int]], body: list[int], lengths: list[int]):
    ids, tables, trees = body[:lengths[0]], body[lengths[0]:lengths[0] + lengths[1]], body[lengths[0] + lengths[1]:]
    i = t = r = 0
    for n, start_pos, sample, table_len, tree_len, prompt_len in per:
        yield ScheduledRequest("", tuple(ids[i:i + n]), start_pos, tuple(tables[t:t + table_len]), bool(sample),
                               tuple(trees[r:r + tree_len]), prompt_len)
        i, t, r = i + n, t + table_len, r + tree_len
