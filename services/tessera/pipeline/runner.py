"""Stage 0 of a pipeline: a model runner (ModelRunner's execute(plan) contract) that embeds the
step's tokens, runs its own layer range with the one layer driver, and sends the hidden states
to stage 1 over the M2N transport; the last stage sends the logits back.

The step's entries are cut into micro-batches (pipeline/micro_batches.py: LLM-PQ's hybrid
rule) that follow each other around the ring: stage 0 runs micro-batch i + 1 while stage 1
runs micro-batch i, and so on down the pipeline. At most `window` micro-batches are in flight
(no more than each link has receive slots), so a stage never waits for a slot that only a
later micro-batch would free. With no later stages this is the whole model in one process.

At the detailed trace level a step is a `pipeline.step` span (tracing_detail.py says whose
trace it joins) with, per micro-batch, `pipeline.compute` (this stage's layers), `m2n.send`
(the transfer to stage 1, whose context the message carries: the later stages' spans are its
descendants) and `m2n.recv` (waiting for the logits).

A step that fails (a stage rejected a micro-batch, died, or its output did not come back
within timeout_s) raises: the engine fails that step's requests. The next step first
relinks the ring (`relink`: the two-round Connect of pipeline/control.py), which also tells
a stage that came back after a crash where its neighbours are.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from tessera import tracing, tracing_detail
from tessera.batch import build_forward_batch
from tessera.model_runner import ModelRunner
from tessera.models.driver import final_hidden, run_layers
from tessera.models.llama import CausalLM
from tessera.pipeline.micro_batches import logit_rows, split_micro_batches, sub_plan
from tessera.pipeline.shard import SLOTS
from tessera.pipeline.wire import encode_step
from tessera.scheduler import StepPlan
from tessera.transport.base import COMBINE, DISPATCH, Tag, Transport, TransportError


class PipelineRunner(ModelRunner):
    step_graphs_apply = False   # execute is its own: stages, micro-batches

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, layers: range,
                 transport: Transport | None = None, stages: list[str] = (), micro_batches: int | None = None,
                 prefill_size: int = 1, timeout_s: float = 10.0, relink: Callable[[], None] | None = None,
                 window: int = SLOTS) -> None:
        """stages: the endpoint names of stages 1 .. N-1; micro_batches: decode micro-batches
        per step (default N)."""
        super().__init__(model, num_blocks, block_size, layers)
        self.layers, self.transport, self.stages = layers, transport, list(stages)
        self.micro_batches = micro_batches or len(self.stages) + 1
        self.prefill_size, self.timeout_s, self.relink, self.window = prefill_size, timeout_s, relink, window
        self.step = 0
        self.failed_steps = 0
        self.resync = False
        self.compute_s = 0.0   # this stage's layers (and, alone, the head)
        self.wait_s = 0.0      # waiting for the last stage's logits
        self._trace: tracing_detail.StepTrace | None = None   # the running step's, when traced

    def request_resync(self) -> None:
        """Relink before the next step (any thread may ask: a stage was seen restarted)."""
        self.resync = True

    def execute(self, plan: StepPlan) -> torch.Tensor:
        try:
            if self.resync and self.relink is not None:
                self.resync = False   # before relinking: a request for another one meanwhile stays
                self.relink()
            with tracing_detail.step("pipeline.step", plan, step=self.step) as self._trace:
                return self._execute(plan)
        except Exception:
            self.failed_steps += 1
            self.resync = True
            self.step += 1
            raise

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> torch.Tensor:
        groups = split_micro_batches(plan, self.micro_batches, self.prefill_size)
        plans = [sub_plan(plan, g) for g in groups]
        m = len(plans)
        logits: list[torch.Tensor | None] = [None] * m
        for i, p in enumerate(plans):
            if self.stages and i >= self.window:
                logits[i - self.window] = self._receive(i - self.window)
            logits[i] = self._run(i, m, p)
        for j in range(max(0, m - self.window), m):
            if logits[j] is None:
                logits[j] = self._receive(j)
        self.step += 1
        out = torch.cat(logits)
        ordered = torch.empty_like(out)
        ordered[torch.tensor(logit_rows(plan, groups), dtype=torch.long)] = out
        return ordered

    def _run(self, mb: int, m: int, plan: StepPlan) -> torch.Tensor | None:
        """Micro-batch mb through this stage's layers, then on to stage 1 (None: its logits
        come back later), or, with no later stages, its logits."""
        t0 = time.perf_counter()
        batch = build_forward_batch(plan, self.block_size)
        x = run_layers(self.model, self.model.embed_tokens(batch.input_ids), batch, self.kv_caches, self.layers)
        if not self.stages:
            x = self.model.compute_logits(final_hidden(self.model, x, batch))
        t1 = time.perf_counter()
        send = None
        if self._trace is not None:
            self._trace.record("pipeline.compute", t0, t1, stage=0, micro_batch=mb, tokens=int(batch.input_ids.numel()))
            send = self._trace.producer("m2n.send", stage=0, micro_batch=mb) if self.stages else None
        if not self.stages:
            self.compute_s += t1 - t0
            return x
        try:
            message = encode_step(plan, x, m, tracing_detail.words(send))
            self.compute_s += time.perf_counter() - t0
            self.transport.send(self.stages[0], Tag(self.step, mb, 1, DISPATCH), message)
        finally:
            tracing.end(send)
        return None

    def _receive(self, mb: int) -> torch.Tensor:
        """Micro-batch mb's logits from the last stage. Messages of an earlier step (sent before
        a failure was noticed) are dropped; anything else unexpected fails the step."""
        last, want = self.stages[-1], Tag(self.step, mb, 0, COMBINE)
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"micro-batch {mb} of step {self.step} not back from {last} "
                                     f"within {self.timeout_s:g} s")
            tag, tensor = self.transport.take_any(last, COMBINE, mb, remaining)
            if tag.step < self.step:
                self.transport.release(last, tag)
                continue
            if tag != want:
                raise TransportError(f"expected {want} from {last}, got {tag}")
            out = tensor.clone()
            self.transport.release(last, tag)
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if self._trace is not None:
                self._trace.record("m2n.recv", t0, t1, stage=0, micro_batch=mb)
            return out
