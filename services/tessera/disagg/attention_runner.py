"""The attention side of AFD: a model runner (same execute(plan) contract as ModelRunner) that
keeps embeddings, attention halves, KV cache, FFN norms, routers, shared experts and the LM
head, and sends each layer's FFN compute to the expert nodes over the M2N transport. The
layers themselves are models/driver.layer_steps, paused at each FFN compute.

Ping-pong (docs/design/disaggregation.md#ping-pong): the step's requests are split into m
micro-batches that move through the layers one behind the other: micro-batch i runs layer l's
attention as soon as its layer l-1 reply is back, so the expert nodes compute micro-batch i while
this node runs attention for micro-batch i + 1 (or for micro-batch 0 of the next layer).

At the detailed trace level a step is an `afd.step` span (tracing_detail.py says whose trace
it joins) with, per layer and micro-batch, `afd.attention`, `m2n.send` (the dispatch) and
`m2n.recv` (waiting for and summing the replies); the step's control message carries its
context to the expert nodes.

A step that fails (an expert node rejected a message, died, or did not answer within
timeout_s) raises; the engine fails that step's requests, and the next step first
resynchronises every link: `reconnect(node)` (the control plane: a gRPC Connect, or the
in-process twin) resets the expert's side, and our own slots from that node are dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from tessera import tracing_detail
from tessera.batch import build_forward_batch
from tessera.disagg.expert_shard import CONTROL_LAYER, control_message, encode, expert_owners, split_range
from tessera.model_runner import ModelRunner
from tessera.models.driver import LayerSteps, final_hidden, layer_steps
from tessera.models.llama import CausalLM, FFNInput
from tessera.scheduler import StepPlan
from tessera.transport.base import COMBINE, DISPATCH, Tag, Transport


@dataclass
class _InFlight:
    layer: int
    x: torch.Tensor                   # the FFN input's hidden states (shape and dtype of the reply)
    selected: list[torch.Tensor | None]  # per expert node: token rows sent (None: all, dense)

class AttentionRunner(ModelRunner):
    step_graphs_apply = False   # execute is its own: FFNs on the expert nodes

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, transport: Transport,
                 expert_nodes: list[str], micro_batches: int = 1, timeout_s: float = 30.0,
                 reconnect: Callable[[str], None] | None = None,
                 placement: list[tuple[int, ...]] | None = None) -> None:
        """placement[j]: the experts expert node j holds (default: contiguous ranges)."""
        super().__init__(model, num_blocks, block_size)
        if micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        self.transport, self.expert_nodes = transport, expert_nodes
        self.micro_batches, self.timeout_s = micro_batches, timeout_s
        cfg = model.config
        if cfg.num_experts:
            placement = placement or [tuple(range(*split_range(cfg.num_experts, len(expert_nodes), j)))
                                      for j in range(len(expert_nodes))]
            self.owner = expert_owners(placement, cfg.num_experts)   # expert id -> node index
        self.step = 0
        self.tokens_out = 0
        self.reconnect = reconnect
        self.failed_steps = 0
        self._resync = False
        self.attn_s = 0.0    # profiling: attention halves + dispatch (T_a), and waits for replies
        self.wait_s = 0.0
        self._trace: tracing_detail.StepTrace | None = None   # the running step's, when traced

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self._resync:
            for node in self.expert_nodes:
                if self.reconnect is not None:
                    self.reconnect(node)
                self.transport.reset(node)
            self._resync = False
        with tracing_detail.step("afd.step", plan, step=self.step) as self._trace:
            try:
                return self._execute(plan)
            except Exception:
                self.failed_steps += 1
                self._resync = True
                self.step += 1
                raise

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> torch.Tensor:
        entries = list(plan.scheduled)
        m = min(self.micro_batches, len(entries))
        groups = [entries[slice(*split_range(len(entries), m, i))] for i in range(m)]
        batches = [build_forward_batch(StepPlan(tuple(g)), self.block_size) for g in groups]
        control = control_message(m, self._trace.words() if self._trace is not None else None)
        for node in self.expert_nodes:
            self.transport.send(node, Tag(self.step, 0, CONTROL_LAYER, DISPATCH), control)
        model, layers = self.model, range(len(self.model.layers))
        steps = [layer_steps(model, model.embed_tokens(b.input_ids), b, self.kv_caches, layers) for b in batches]
        # Micro-batch i enters layer l as soon as its layer l-1 reply is back, while the
        # expert nodes work on the micro-batches dispatched after it (the ping-pong).
        flights = [self._advance(i, s, None) for i, s in enumerate(steps)]
        for _ in layers:
            flights = [self._advance(i, s, self._combine(i, f)) for i, (s, f) in enumerate(zip(steps, flights))]
        hidden = torch.cat([final_hidden(model, x, b) for x, b in zip(flights, batches)])
        self.step += 1
        return model.compute_logits(hidden)

    def _advance(self, mb: int, steps: LayerSteps, y: torch.Tensor | None) -> _InFlight | torch.Tensor:
        """Hand micro-batch mb its last FFN output y and run it to its next FFN: dispatch that
        FFN's input and return it in flight, or, past the last layer, return the hidden states."""
        t0 = time.perf_counter()
        try:
            layer, ffn_in = steps.send(y)
        except StopIteration as done:
            return done.value
        t1 = time.perf_counter()
        flight = self._dispatch(layer, mb, ffn_in)
        t2 = time.perf_counter()
        self.attn_s += t2 - t0
        if self._trace is not None:
            self._trace.record("afd.attention", t0, t1, layer=layer, micro_batch=mb)
            self._trace.record("m2n.send", t1, t2, layer=layer, micro_batch=mb, tokens=int(ffn_in.x.shape[0]))
        return flight

    def _dispatch(self, layer: int, mb: int, ffn_in: FFNInput) -> _InFlight:
        tag = Tag(self.step, mb, layer, DISPATCH)
        message = encode(ffn_in)
        if ffn_in.ids is None:   # dense: every node holds a column range and sees every token
            for node in self.expert_nodes:
                self.transport.send(node, tag, message)
            return _InFlight(layer, ffn_in.x, [None] * len(self.expert_nodes))
        selected = []
        owners = self.owner[ffn_in.ids]   # [tokens, k]: the node of each chosen expert
        for j, node in enumerate(self.expert_nodes):
            rows = (owners == j).any(dim=-1).nonzero().squeeze(1)
            self.transport.send(node, tag, message[rows])
            self.tokens_out += int(rows.numel())
            selected.append(rows)
        return _InFlight(layer, ffn_in.x, selected)

    def _combine(self, mb: int, f: _InFlight) -> torch.Tensor:
        """The FFN output of one micro-batch: the sum of the expert nodes' partial outputs (an
        expert node that rejected the message raises PeerError here)."""
        tag = Tag(self.step, mb, f.layer, COMBINE)
        start = time.perf_counter()
        y = torch.zeros_like(f.x)
        for node, rows in zip(self.expert_nodes, f.selected):
            t0 = time.perf_counter()
            reply = self.transport.recv(node, tag, self.timeout_s)
            self.wait_s += time.perf_counter() - t0
            if rows is None:
                y += reply
            else:
                y.index_add_(0, rows, reply.to(y.dtype))
            self.transport.release(node, tag)
        if self._trace is not None:
            self._trace.record("m2n.recv", start, time.perf_counter(), layer=f.layer, micro_batch=mb)
        return y

    def stop_experts(self) -> None:
        for node in self.expert_nodes:
            self.transport.send(node, Tag(self.step, 0, CONTROL_LAYER, DISPATCH), torch.tensor([-1.0]))
