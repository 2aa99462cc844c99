"""Decode steps replayed without Python: the CPU's counterpart of vLLM's CUDA graphs (and, as
there, `--enforce-eager` turns them off).

A decode step of B requests (one new token each, no draft tree) makes the same C kernel calls
with the same shapes at every step; what changes is the values in a few inputs: the hidden
states out of the embedding, RoPE's cos and sin of the positions, the slots the new K/V go to,
the block tables and the context lengths. A DecodeGraph keeps those inputs in buffers of its
own, runs one step through the layer driver while tessera_kernels.replay records its calls,
and at later steps of B requests copies the step's inputs into its buffers and makes the same
calls again. Measured on AMD EPYC Zen 4 (2 cores, SmolLM2-135M, bf16, batch 1): the step's
Python, ~5.8 of ~14.5 ms, goes.

Trust: a recording that met a torch op computing something (replay.Recording.refused: an MoE
router, a dtype without C kernels, a linear on oneDNN) is not kept and that batch size stays
eager; a kept one is replayed once beside the eager step on the same inputs and must give the
same bits before it serves, else it is dropped and a warning logged. The weights must not be
edited in place while graphs exist (the serving engine never does); the graph holds them, and
every buffer its calls point into, alive.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from tessera.batch import ForwardBatch
from tessera.models.driver import KVCaches, final_hidden, forward, run_layers
from tessera.models.llama import CausalLM
from tessera_kernels import replay

log = logging.getLogger(__name__)

MAX_BATCH = 64       # graphs for 1..64 requests (a larger batch runs eagerly)
_ATTEMPTS = 2        # recordings tried per batch size (the first may meet a weight packed on first use)


def pure_decode(batch: ForwardBatch) -> bool:
    """Every token is a decode token whose logits are sampled, all on the paged kernel's rows."""
    T = batch.num_tokens
    return (not batch.prefills and batch.decode_token_idx.numel() == T and batch.logits_idx.numel() == T
            and batch.causal_token_idx is not None and batch.causal_token_idx.numel() == T)


class DecodeGraph:
    """One batch size's recorded step and the input buffers its calls read."""

    def __init__(self, model: CausalLM, batch_size: int, max_blocks: int) -> None:
        B, dtype = batch_size, model.embed_tokens.weight.dtype
        D = model.rope.cos.shape[-1]
        self.x = torch.empty(B, model.config.hidden_size, dtype=dtype)
        self.cos = torch.empty(B, 1, D, dtype=dtype)
        self.sin = torch.empty(B, 1, D, dtype=dtype)
        self.slots = torch.zeros(B, dtype=torch.long)
        self.tables = torch.zeros(B, max_blocks, dtype=torch.long)   # the kernel reads a row's first blocks only
        self.lens = torch.ones(B, dtype=torch.long)
        self.rows = torch.arange(B)
        self.recording: replay.Recording | None = None
        self.out: torch.Tensor | None = None
        self.verified = False

    def _load(self, model: CausalLM, batch: ForwardBatch) -> ForwardBatch:
        """The step's inputs into this graph's buffers; the batch as its calls see it."""
        self.x.copy_(model.embed_tokens(batch.input_ids))
        cos, sin = model.rope(batch.positions, self.x.dtype)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.slots.copy_(batch.slot_mapping)
        self.lens.copy_(batch.causal_context_lens)
        self.tables[:, :batch.causal_block_tables.shape[1]] = batch.causal_block_tables
        return dataclasses.replace(batch, slot_mapping=self.slots, causal_token_idx=self.rows,
                                   causal_block_tables=self.tables, causal_context_lens=self.lens)

    def capture(self, model: CausalLM, batch: ForwardBatch, kv_caches: KVCaches, pool: replay.Pool) -> torch.Tensor:
        """Run the step's layers eagerly while recording them, their buffers from `pool`: the
        hidden states after the last layer (valid whether or not the recording can be kept)."""
        static = self._load(model, batch)
        with replay.record(pool) as rec:
            out = run_layers(model, self.x, static, kv_caches, rope=(self.cos, self.sin))
        if rec.refused is None and not rec.calls:
            rec.refused = "no C kernel calls"
        self.recording, self.out = rec, out
        return out

    def replay(self, model: CausalLM, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states after the last layer, in this graph's buffer (overwritten by the
        next replay)."""
        self._load(model, batch)
        self.recording.replay()
        return self.out


class DecodeGraphs:
    """The graphs of one model and KV cache, one per batch size up to max_batch, made on first
    need; `forward` is driver.forward's contract. Their intermediate buffers share one pool (one
    graph runs at a time): its size is the largest graph's (SmolLM2: ~0.6 MB a request)."""

    def __init__(self, model: CausalLM, kv_caches: KVCaches, max_blocks: int, max_batch: int = MAX_BATCH) -> None:
        self.model, self.kv_caches, self.max_blocks, self.max_batch = model, kv_caches, max_blocks, max_batch
        self.graphs: dict[int, DecodeGraph] = {}
        self.attempts: dict[int, int] = {}
        self.replayed_steps = 0
        self.pool = replay.Pool()
        self._held: dict[int, torch.Tensor] = {}   # what the recorded calls point into besides the graphs' buffers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        B = batch.num_tokens
        if (not pure_decode(batch) or B > self.max_batch or batch.causal_block_tables.shape[1] > self.max_blocks
                or (B not in self.graphs and self.attempts.get(B, 0) >= _ATTEMPTS)):
            return forward(self.model, batch, self.kv_caches)
        graph = self.graphs.get(B)
        if graph is None:
            return final_hidden(self.model, self._capture(B, batch), batch)
        if not graph.verified:
            eager = forward(self.model, batch, self.kv_caches)
            replayed = final_hidden(self.model, graph.replay(self.model, batch), batch)
            if torch.equal(eager, replayed):
                graph.verified = True
            else:
                del self.graphs[B]
                self.attempts[B] = _ATTEMPTS
                log.warning("decode graph for %d requests differs from the eager step: batch size left eager", B)
            return eager
        self.replayed_steps += 1
        return final_hidden(self.model, graph.replay(self.model, batch), batch)

    def _capture(self, B: int, batch: ForwardBatch) -> torch.Tensor:
        self.attempts[B] = self.attempts.get(B, 0) + 1
        graph = DecodeGraph(self.model, B, self.max_blocks)
        out = graph.capture(self.model, batch, self.kv_caches, self.pool)
        refused = graph.recording.refused
        if refused is None and self.pool.overflowed:
            # a larger pool for the next recordings; those made from the old one are made again
            self.pool.grow()
            self.graphs.clear()
            self.attempts[B] -= 1
        elif refused is None:
            self.graphs[B] = graph
            self._held.update((id(t), t) for t in _weights(self.model))
        else:
            log.info("decode step of %d requests not recorded (%s): it runs eagerly", B, refused)
        return out


def _weights(model: CausalLM) -> list[torch.Tensor]:
    """The parameters and the kernels' packed copies of them (made on first use)."""
    derived = [getattr(m, name, None) for m in model.modules() for name in ("_packed", "_blocked")]
    return list(model.parameters()) + [t for t in derived if isinstance(t, torch.Tensor)]
