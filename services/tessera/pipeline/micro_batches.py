"""LLM-PQ's hybrid micro-batch rule (docs/design/pipeline.md#micro-batches), applied to one engine
step: the step's entries are split into micro-batches that follow each other through the pipeline
stages.

    decode entries (one new token each)   -> m micro-batches of ceil(B / m)  (m: the stage count
                                             by default, so that every stage has one to work on)
    prefill chunks (and draft trees)      -> micro-batches of xi entries each

Plain Python on the scheduler's StepPlan; the runner turns each micro-batch into a ForwardBatch
(batch.build_forward_batch) as for a whole step, and `logit_rows` says where each
micro-batch's logits go in the step's plan order.
"""
from __future__ import annotations

from tessera.scheduler import ScheduledRequest, StepPlan


def is_decode(entry: ScheduledRequest) -> bool:
    """batch.py's rule: one new token after a context, no draft tree."""
    return len(entry.token_ids) == 1 and entry.start_pos > 0 and not entry.tree_parents


def split_micro_batches(plan: StepPlan, decode_micro_batches: int, prefill_size: int) -> list[list[int]]:
    """Indices of plan.scheduled per micro-batch: prefill micro-batches first (the larger work
    enters the pipeline first, so the drain at the step's end is short), then the decode ones.
    Every entry is in exactly one micro-batch; an empty plan has none."""
    if decode_micro_batches < 1 or prefill_size < 1:
        raise ValueError("micro-batch counts and sizes must be >= 1")
    decode = [i for i, e in enumerate(plan.scheduled) if is_decode(e)]
    prefill = [i for i, e in enumerate(plan.scheduled) if not is_decode(e)]
    groups = [prefill[j:j + prefill_size] for j in range(0, len(prefill), prefill_size)]
    if decode:
        size = -(-len(decode) // decode_micro_batches)
        groups += [decode[j:j + size] for j in range(0, len(decode), size)]
    return groups


def sub_plan(plan: StepPlan, group: list[int]) -> StepPlan:
    return StepPlan(tuple(plan.scheduled[i] for i in group))


def logit_rows(plan: StepPlan, groups: list[list[int]]) -> list[int]:
    """For the micro-batches' logits concatenated in group order, the row of each in the step's
    logits (the plan order ModelRunner.execute returns: one row per sampled entry, one per node
    of a draft tree)."""
    start, row = [], 0
    for e in plan.scheduled:
        start.append(row)
        row += _rows(e)
    return [start[i] + k for group in groups for i in group for k in range(_rows(plan.scheduled[i]))]


def _rows(entry: ScheduledRequest) -> int:
    if entry.tree_parents:
        return len(entry.token_ids)
    return 1 if entry.sample else 0
