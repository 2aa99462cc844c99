"""A pipeline plan (what every planner method returns, what `tessera plan pq` writes) and its
validator, docs/design/pipeline.md#invariants rule 1: every layer once, contiguous stages in
pipeline order, the first and last layers on the first and last stages, and every device's memory
(its layers' weights at their bit-widths, full-length KV for all decode micro-batches, temporaries,
the embedding on stage 0 and the LM head on the stage the runtime keeps it: CostModel.head_stage)
within its budget.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from tessera.pipeline.costmodel import MemoryModel
from tessera.pipeline.devices import Device


class PlanError(ValueError):
    """A plan that breaks an invariant: the message names the stage and the rule."""


@dataclass(frozen=True)
class Stage:
    device: str
    device_type: str
    start: int                   # layers [start, end)
    end: int
    bits: tuple[int, ...]        # one per layer of the stage
    prefill_s: float             # predicted stage time, one prefill micro-batch
    decode_s: float              # predicted stage time, one decode micro-batch
    memory_bytes: float          # layers + temporaries (+ stage 0's extras)
    budget_bytes: float


@dataclass(frozen=True)
class Plan:
    method: str                  # 'llm-pq', 'llm-pq (heuristic)', 'pipeedge', 'uniform', 'adabits'
    model: str
    batch: int                   # global batch B
    prompt_len: int              # s
    gen_len: int                 # n
    xi: int                      # prefill micro-batch size
    decode_micro_batch: int      # ⌈B / N⌉
    stages: tuple[Stage, ...]
    objective: float             # the ILP objective of this assignment (θ·Σω with normalized ω)
    prefill_s: float             # predicted time of the batch's prefill
    decode_s: float              # predicted time of its decode rounds
    omega_sum: float             # Σω of the indicator as given (not normalized)
    planning_s: float
    status: str                  # solver outcome
    label: str                   # where the latencies come from: 'simulated (roofline)' or 'profiled'

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.stages)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def throughput_tok_s(self) -> float:
        """Predicted: B·n generated tokens over the predicted total time."""
        return self.batch * self.gen_len / self.total_s

    @property
    def layer_bits(self) -> tuple[int, ...]:
        return tuple(b for s in self.stages for b in s.bits)

    def layout(self) -> str:
        """'dev[0:12) 16x8 8x4 | ...': each stage's layers and bit-width counts."""
        parts = []
        for s in self.stages:
            counts = " ".join(f"{b}x{s.bits.count(b)}" for b in sorted(set(s.bits), reverse=True))
            parts.append(f"{s.device}[{s.start}:{s.end}) {counts}")
        return " | ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(order=list(self.order), total_s=self.total_s, throughput_tok_s=self.throughput_tok_s)
        return d


def stage_fixed_bytes(memory: MemoryModel, first: bool, head: bool, xi: int, prompt_len: int, decode_batch: int,
                      full_len: int) -> float:
    """Bytes a stage holds besides its layers: temporaries, the first stage's embeddings, the
    head and logits where the runtime keeps them (CostModel.head_stage)."""
    fixed = memory.temp_bytes(xi, prompt_len, decode_batch, full_len)
    return fixed + memory.extras_bytes(xi, decode_batch, first, head)


def validate(plan: Plan, layers: int, memory: MemoryModel, devices: Mapping[str, Device],
             allowed_bits: Sequence[int], head_stage: int | None = None) -> None:
    """Raise PlanError unless the plan satisfies invariant 1 (memory recomputed here); the head
    is on stage head_stage (default: the last, as our runtime keeps it)."""
    if not plan.stages:
        raise PlanError("the plan has no stages")
    if plan.stages[0].start != 0:
        raise PlanError(f"layer 0 is not on the first stage ({plan.stages[0].device} starts at {plan.stages[0].start})")
    if plan.stages[-1].end != layers:
        last = plan.stages[-1]
        raise PlanError(f"the last stage ({last.device}) ends at {last.end}, not at layer {layers}")
    if len({s.device for s in plan.stages}) != len(plan.stages):
        raise PlanError("a device appears in two stages")
    for prev, s in zip(plan.stages, plan.stages[1:]):
        if s.start != prev.end:
            raise PlanError(f"stages not contiguous: {prev.device} ends at {prev.end}, {s.device} starts at {s.start}")
    full = plan.prompt_len + plan.gen_len
    head = len(plan.stages) - 1 if head_stage is None else head_stage
    for j, s in enumerate(plan.stages):
        if s.end <= s.start or len(s.bits) != s.end - s.start:
            raise PlanError(f"stage {s.device}: layers [{s.start}, {s.end}) with {len(s.bits)} bit-widths")
        bad = sorted(set(s.bits) - set(allowed_bits))
        if bad:
            raise PlanError(f"stage {s.device}: bit-widths {bad} not among {tuple(allowed_bits)}")
        if s.device not in devices:
            raise PlanError(f"stage {s.device}: no such device")
        need = sum(memory.layer_bytes(b, plan.batch, full) for b in s.bits)
        need += stage_fixed_bytes(memory, j == 0, j == head, plan.xi, plan.prompt_len, plan.decode_micro_batch, full)
        budget = devices[s.device].budget_bytes()
        if need > budget * (1 + 1e-9):
            raise PlanError(f"stage {s.device}: needs {need / 2**20:.1f} MiB (weights, full-length KV for "
                            f"{plan.batch} sequences, temporaries, embeddings / head where held) but its budget "
                            f"is {budget / 2**20:.1f} MiB")
