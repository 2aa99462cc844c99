"""Steps replayed without Python: the CPU's counterpart of vLLM's CUDA graphs (and, as there,
`--enforce-eager` turns them off).

A step whose every token attends as a causal row of the paged-attention kernel (decode tokens,
and the tokens of prompt chunks in steps of at most MAX_TOKENS tokens; not a draft tree's)
makes the same C kernel calls with the same shapes as any other step of as many rows: the
rows are the tokens, whichever requests they belong to, and what changes is the values in a
few inputs: the hidden states out of the embedding, RoPE's cos and sin of the positions (made
before the calls, so that RoPE scaling that depends on the prompt's length is replayed too), the
slots the new K/V go to, each row's block table and context length. Those inputs live in
buffers of StepGraphs' own (Inputs); once per row count T a step runs through the layer
driver while tessera_kernels.replay records its calls, and later steps of T rows copy their
inputs into the buffers and make the same calls again; the rows whose logits are sampled are
picked afterwards. What goes is the step's Python between the kernels, a large share of a
small model's decode step and of a short prompt's (docs/performance-notes.md). The first two
steps of each row count pay for its recording and check (each costs more than an eager step);
the worker's warm-up makes them (entrypoints/worker.py).

Padding: a step of T > PAD_FROM tokens replays the graph of rows(T) rows, T rounded up to a
multiple of PAD_TO, its extra rows padding (vLLM pads a step to its next CUDA-graph size the
same way): a zero hidden state, attending to one slot of block 0, its K/V written nowhere
(paged_attention_cpu.PAD_SLOT). Every kernel computes a row from that row's inputs alone, in the
same order at any row count (the AMX tiles work in blocks of 16 rows anyway; the attention
kernel puts a padding row in no prompt tile), so the real rows get the same bits as at T rows,
and the check below compares them with the eager step of T tokens (a recording that pads serves
the eager step's bits). Prompts of varied lengths then share 15 graphs from 17 to 256 tokens
instead of recording 240, and a prompt of a new length rarely pays for a recording and a check.

Trust: a recording that met a torch op computing something (replay.Recording.refused: an MoE
router, a dtype without C kernels, a linear on oneDNN) is not kept and, after a second try,
that row count stays eager (and after refusals at REFUSED_SIZES counts with none kept, every
count). A kept one is replayed once beside the eager step on the same inputs and must give the
same bits before it serves, else it is dropped and a warning logged; so is one whose replay
fails (a call returning other than it did when recorded). With check_every N (EngineConfig's
replay_check_every; on in the test suite), every Nth replayed step is checked the same way
again: a graph that stops matching (a value the recording baked in, a kernel whose path
depends on values, not shapes) is logged, counted (mismatches) and dropped. The graphs hold
every buffer their calls point into, the weights' memory included: a weight edited in place or
moved after they were recorded is not seen by them (the serving engine never does either; the
tools that edit weights run their own runners).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from tessera.batch import ForwardBatch
from tessera.layers.attention import PROMPTS_ON_KERNEL_UP_TO
from tessera.models.driver import KVCaches, final_hidden, forward, run_layers
from tessera.models.llama import CausalLM
from tessera_kernels import replay
from tessera_kernels.paged_attention_cpu import PAD_SLOT

log = logging.getLogger(__name__)

# Graphs for steps of 1..MAX_TOKENS tokens (more run eagerly): attention keeps prompt chunks
# on the paged kernel in such steps (torch's SDPA, which cannot be recorded, takes the long
# ones in larger steps on AMX). The buffers of the largest graph grow with it: SmolLM2 in
# bf16, 0.58 MB a token (147 MB at 256).
MAX_TOKENS = PROMPTS_ON_KERNEL_UP_TO
_ATTEMPTS = 2        # refused recordings per row count before it stays eager (a second chance
                     # for a refusal that came from work made once, outside replay.paused())
# bytes beyond a step's tokens times its bytes per token: each buffer starts on a cache line
_ALIGNMENT_SLACK = 1 << 20
REFUSED_SIZES = 4    # row counts refused with no graph kept: the model's steps cannot be recorded
PAD_FROM = 16        # steps of up to this many tokens get a graph of their own size
PAD_TO = 16          # larger ones replay the graph of their count rounded up to a multiple of this


def all_causal_rows(batch: ForwardBatch) -> bool:
    """Every token is a row of the paged kernel, attending causally (no draft tree)."""
    return batch.causal_token_idx is not None and batch.causal_token_idx.numel() == batch.num_tokens


class Inputs:
    """What changes from one step to the next, in buffers for up to max_tokens tokens that
    every graph's calls read: a graph of R rows reads their first R."""

    def __init__(self, model: CausalLM, max_tokens: int, max_blocks: int) -> None:
        dtype, D = model.embed_tokens.weight.dtype, model.rope.cos.shape[-1]
        self.x = torch.empty(max_tokens, model.config.hidden_size, dtype=dtype)
        self.cos = torch.empty(max_tokens, 1, D, dtype=dtype)
        self.sin = torch.empty(max_tokens, 1, D, dtype=dtype)
        self.slots = torch.zeros(max_tokens, dtype=torch.long)
        # a step's tables fill the first columns: the kernel reads only a row's first blocks
        self.tables = torch.zeros(max_tokens, max_blocks, dtype=torch.long)
        self.lens = torch.ones(max_tokens, dtype=torch.long)
        self.rows = torch.arange(max_tokens)   # attention reads only how many there are: all of them attend causally

    def load(self, model: CausalLM, batch: ForwardBatch, rows: int) -> tuple[torch.Tensor, ForwardBatch, tuple]:
        """The step's T tokens into the first T of `rows` rows, padding after them (see the
        module docstring): hidden states, the batch and (cos, sin) as the calls see them. A
        row's table fills the first columns; the kernel reads no further than its context."""
        T = batch.num_tokens
        x = self.x[:rows]
        x[:T].copy_(model.embed_tokens(batch.input_ids))
        cos, sin = model.rope(batch.positions, x.dtype, batch.prompt_lens)
        self.cos[:T].copy_(cos)
        self.sin[:T].copy_(sin)
        self.slots[:T].copy_(batch.slot_mapping)
        self.lens[:T].copy_(batch.causal_context_lens)
        self.tables[:T, :batch.causal_block_tables.shape[1]] = batch.causal_block_tables
        if rows > T:
            for padding in (x[T:], self.cos[T:rows], self.sin[T:rows], self.tables[T:rows, :1]):
                padding.zero_()
            self.slots[T:rows] = PAD_SLOT
            self.lens[T:rows] = 1
        static = dataclasses.replace(batch, slot_mapping=self.slots[:rows], causal_token_idx=self.rows[:rows],
                                     causal_block_tables=self.tables[:rows], causal_context_lens=self.lens[:rows])
        return x, static, (self.cos[:rows], self.sin[:rows])


class StepGraph:
    """One row count's recorded step."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.recording: replay.Recording | None = None
        self.out: torch.Tensor | None = None
        self.verified = False

    def capture(self, model: CausalLM, batch: ForwardBatch, kv_caches: KVCaches, inputs: Inputs,
                pool: replay.Pool) -> torch.Tensor:
        """Run the step's layers eagerly on self.rows rows while recording them, their buffers
        from `pool`: the hidden states after the last layer (valid whether or not the recording
        can be kept), the step's tokens in the first rows."""
        x, static, rope = inputs.load(model, batch, self.rows)
        with replay.record(pool) as rec:
            out = run_layers(model, x, static, kv_caches, rope=rope)
        if rec.refused is None and not rec.calls:
            rec.refused = "no C kernel calls"
        self.recording, self.out = rec, out
        return out

    def replay(self, model: CausalLM, batch: ForwardBatch, inputs: Inputs) -> torch.Tensor:
        """The hidden states after the last layer, in the pool (overwritten by the next replay
        or recording of any graph)."""
        inputs.load(model, batch, self.rows)
        self.recording.replay()
        return self.out


class StepGraphs:
    """The graphs of one model and KV cache, one per row count up to max_tokens, made on
    first need; `forward` is driver.forward's contract. One graph runs at a time, so they share
    their inputs (Inputs) and one pool for their intermediate buffers, sized at the first
    recording for a step of max_tokens (SmolLM2 in bf16: 0.58 MB a token, 147 MB, held besides
    the KV cache; its pages are touched as steps of as many tokens come)."""

    def __init__(self, model: CausalLM, kv_caches: KVCaches, max_blocks: int, max_step_tokens: int,
                 check_every: int = 0) -> None:
        """check_every N > 0: every Nth replayed step is checked against the eager step too."""
        self.model, self.kv_caches, self.max_blocks = model, kv_caches, max_blocks
        self.check_every = check_every
        self.max_tokens = min(max_step_tokens, MAX_TOKENS)
        self.inputs = Inputs(model, self.max_tokens, max_blocks)
        self.pool = replay.Pool()
        self.graphs: dict[int, StepGraph] = {}
        self.refusals: dict[int, int] = {}       # recordings refused, per row count
        self.dropped: set[int] = set()           # row counts whose graph failed its check or a replay
        self.replayed_steps = 0
        self.checked_steps = 0                   # replayed steps checked again (check_every)
        # The test suite turns a re-check's mismatch into an error: there the step's eager
        # output would otherwise hide a replay bug from every test that compares tokens.
        self.strict = os.environ.get("TESSERA_REPLAY_CHECK_STRICT") == "1"
        self.mismatches = 0                      # of those, the ones that differed from the eager step
        self.kept_any = False                    # whether a recording was ever kept (the pool's growth drops them)
        # by address: what the recorded calls point into besides the inputs and the pool
        self._held: dict[int, torch.Tensor] = {}

    def rows(self, T: int) -> int:
        """The rows of the graph a step of T tokens replays (padding: the module docstring)."""
        return min(-(-T // PAD_TO) * PAD_TO, self.max_tokens) if T > PAD_FROM else T

    def may_replay(self, R: int) -> bool:
        """Whether steps of R rows may still be recorded or replayed (see Trust above)."""
        return (self.refusals.get(R, 0) < _ATTEMPTS and R not in self.dropped
                and not (len(self.refusals) >= REFUSED_SIZES and not self.kept_any))

    def shortest(self, R: int) -> int:
        """The fewest tokens whose steps replay the graph of R rows (R itself up to PAD_FROM)."""
        return next(T for T in range(min(R, PAD_FROM + 1), R + 1) if self.rows(T) == R)

    def row_counts(self) -> list[int]:
        """Every graph size steps may take: the padded ones of prompts (PAD_FROM + 1 tokens and
        more) first, then 1 to PAD_FROM rows (decode batches, short prompts)."""
        padded = sorted({self.rows(T) for T in range(PAD_FROM + 1, self.max_tokens + 1)})
        return padded + list(range(1, min(PAD_FROM, self.max_tokens) + 1))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        T = batch.num_tokens
        R = self.rows(T)
        if (not all_causal_rows(batch) or T > self.max_tokens or batch.causal_block_tables.shape[1] > self.max_blocks
                or not self.may_replay(R)):
            return forward(self.model, batch, self.kv_caches)
        graph = self.graphs.get(R)
        if graph is None:
            recorded = final_hidden(self.model, self._capture(R, batch), batch)
            if R == T:
                return recorded
            # A recording runs the padded rows, through torch ops too where it was refused (an
            # MoE router, a linear on oneDNN), whose bits may depend on the row count: the step
            # the user gets is the eager one, whose K/V writes are the ones that stay.
            eager = forward(self.model, batch, self.kv_caches)
            if R in self.graphs and not torch.equal(eager, recorded):
                self._drop(R, "differs from the eager step")
            return eager
        try:
            replayed = final_hidden(self.model, graph.replay(self.model, batch, self.inputs), batch)
        except RuntimeError as e:
            self._drop(R, f"failed ({e})")
            return forward(self.model, batch, self.kv_caches)     # writes this step's K/V again
        if graph.verified:
            self.replayed_steps += 1
            if not self.check_every or self.replayed_steps % self.check_every:
                return replayed
            self.checked_steps += 1
        # The first replay (and every check_every-th) is checked against the eager step (of the
        # T tokens, unpadded), which runs after it so that its K/V writes are the ones that stay.
        eager = forward(self.model, batch, self.kv_caches)
        if torch.equal(eager, replayed):
            graph.verified = True
        else:
            self.mismatches += graph.verified
            self._drop(R, "differs from the eager step" + (" on a re-check" if graph.verified else ""))
            if graph.verified and self.strict:
                raise RuntimeError(f"a replayed step of {R} rows differed from the eager step on a re-check")
        return eager

    def _capture(self, R: int, batch: ForwardBatch) -> torch.Tensor:
        graph = StepGraph(R)
        out = graph.capture(self.model, batch, self.kv_caches, self.inputs, self.pool)
        refused = graph.recording.refused
        if refused is not None:
            self.refusals[R] = self.refusals.get(R, 0) + 1
            log.info("step of %d rows not recorded (%s): it runs eagerly", R, refused)
        elif self.pool.overflowed:
            # A larger pool for the next recordings; the graphs made from the old one are made
            # again at their next step. A step's buffers grow in proportion to its tokens (SmolLM2
            # in bf16: 576,000 bytes a token at every count), so the pool is sized for the largest
            # step at the first overflow: the worker's warm-up makes it, and the first prompt of
            # a user no longer grows the pool, drops the graphs and is recorded again (which
            # made the first few prompts after a start slow to their first token).
            self.pool.grow(-(-self.pool.used * self.max_tokens // R) + _ALIGNMENT_SLACK)
            self.graphs.clear()
        else:
            self.graphs[R] = graph
            self.kept_any = True
            self._held.update((t.untyped_storage().data_ptr(), t) for t in _weights(self.model))
        return out

    def _drop(self, R: int, why: str) -> None:
        del self.graphs[R]
        self.dropped.add(R)
        log.warning("step graph of %d rows %s: the steps it served run eagerly", R, why)


def _weights(model: CausalLM) -> list[torch.Tensor]:
    """Every tensor the modules hold now (parameters, buffers, the kernels' packed copies made
    on first use, quantized codes), as new references to their memory: a weight whose storage
    is replaced later (huge_pages.move_weights) leaves the graphs reading the old copy, not
    freed memory."""
    held = list(model.parameters()) + list(model.buffers())
    held += [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    # oneDNN's blocked weights (no storage to key by) are never under a recorded call: a
    # linear on oneDNN makes the recording refuse
    return [t.detach() for t in held if t.layout == torch.strided]
