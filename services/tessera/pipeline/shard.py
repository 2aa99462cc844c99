"""A later pipeline stage (1 .. N-1): its decoder layers (at their bit-widths), the KV cache of
those layers, and the thread that serves micro-batches. Plain Python over the transport;
entrypoints/pipeline_shard.py puts gRPC (Connect, StageInfo) on it.

Each step, micro-batch 0 arrives first and says how many follow (m, pipeline/wire.py); the
thread runs every micro-batch through its layers with the one layer driver
(models/driver.run_layers), the same block tables stage 0 scheduled, and sends the hidden
states on (the last stage: the logits, back to stage 0), one micro-batch behind the other.
A micro-batch that fails here (malformed, or a peer error) is answered downstream with an
error under the tag the next stage expects, so stage 0 learns of it at once; the thread then
drops what it holds from upstream and waits for the next step. A Connect (stage 0 relinking
after a failure) ends whatever step the thread was in.
A micro-batch whose message carries a trace context (stage 0 traces at the detailed level) is a
`pipeline.stage` span under the sender's `m2n.send`, with `pipeline.compute` and its own
`m2n.send` (whose context the next stage's message carries) under it.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from tessera import tracing, tracing_detail
from tessera.batch import build_forward_batch
from tessera.config import ConfigError, EngineConfig
from tessera.model_runner import allocate_kv
from tessera.models.driver import final_hidden, run_layers
from tessera.models.llama import CausalLM
from tessera.pipeline.control import StageInfo, StageLink, StageRefused, StageReply
from tessera.pipeline.memory import GIB, check_budget, kv_bytes, num_kv_blocks, weight_bytes
from tessera.pipeline.stages import StageConfig, check_quantization, stage_bits
from tessera.pipeline.wire import decode_step, encode_step, trace_context
from tessera.transport.base import COMBINE, DISPATCH, PeerError, Tag, Transport, TransportError, send_error

log = logging.getLogger("tessera.pipeline.shard")
IDLE_WAIT_S = 3600.0
SLOTS = 4              # receive slots per link: stage 0 keeps at most this many micro-batches in flight
SLOT_BYTES = 16 << 20  # largest message a stage receives (a micro-batch's hidden states and plan)


class PipelineShard:
    def __init__(self, model: CausalLM, dtype: torch.dtype, stage: int, layers: range, bits: tuple[int, ...],
                 transport: Transport, transport_name: str, model_id: str, num_blocks: int, block_size: int,
                 weight_bytes: int = 0, memory_budget_bytes: int = 0, timeout_s: float = 60.0) -> None:
        """dtype: the model's (its hidden states and KV cache); bits: per layer of `layers`."""
        cfg = model.config
        self.model, self.stage, self.layers, self.bits = model, stage, layers, tuple(bits)
        self.transport, self.transport_name, self.model_id = transport, transport_name, model_id
        self.num_blocks, self.block_size, self.timeout_s = num_blocks, block_size, timeout_s
        self.dtype = dtype
        self.last = layers.stop == cfg.num_layers
        self.kv_caches = allocate_kv(cfg, num_blocks, block_size, self.dtype, layers)
        self.weight_bytes, self.memory_budget_bytes = weight_bytes, memory_budget_bytes
        self.kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in filter(None, self.kv_caches))
        self.micro_batches = self.tokens = self.rejected = 0
        self.compute_s = 0.0
        self.started = time.monotonic()
        self._link: StageLink | None = None
        self._generation = 0
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=f"pipeline-stage-{stage}", daemon=True)
        self._thread.start()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def connect(self, link: StageLink) -> StageReply:
        """Join stage 0's pipeline (see control.py: round 1 without, round 2 with the
        neighbours' metadata). Refuses a pipeline this stage does not fit."""
        self._check(link)
        peers = dict.fromkeys([link.upstream, link.downstream])
        with self._ready:
            old, self._link = self._link, None
            self._generation += 1
            if old is not None:
                self.transport.reset(old.upstream)   # wakes the thread out of the old step
            if all(p in link.peer_metadata for p in peers):
                for p in peers:
                    self.transport.connect(p, link.peer_metadata[p])
                self._link = link
                self._ready.notify_all()
        return StageReply(self.name, {p: self.transport.metadata_for(p) for p in peers})

    @property
    def name(self) -> str:
        return self.transport.name

    def _check(self, link: StageLink) -> None:
        cfg = self.model.config
        wanted = {"transport": (link.transport, self.transport_name), "model": (link.model_id, self.model_id),
                  "layer count": (link.num_layers, cfg.num_layers), "stage index": (link.stage_index, self.stage),
                  "layers": (tuple(link.layers), (self.layers.start, self.layers.stop)),
                  "bits": (tuple(link.bits), self.bits), "dtype": (link.dtype, self.dtype_name),
                  "KV blocks": ((link.num_blocks, link.block_size), (self.num_blocks, self.block_size)),
                  "last stage": (link.stage_index == link.stage_count - 1, self.last)}
        for what, (theirs, ours) in wanted.items():
            if theirs != ours:
                raise StageRefused(f"stage {self.stage} ({self.name}) has {what} {ours}; the pipeline of "
                                   f"{link.pipeline} expects {theirs}")

    def info(self) -> StageInfo:
        link = self._link
        return StageInfo(self.name, self.model_id, self.stage, (self.layers.start, self.layers.stop), self.bits,
                         self.dtype_name, self.transport_name, self.num_blocks, self.block_size, self.weight_bytes,
                         self.kv_bytes, self.memory_budget_bytes, link.pipeline if link else "", self.micro_batches,
                         self.tokens, self.rejected, self.compute_s, time.monotonic() - self.started)

    def _wait_linked(self) -> tuple[StageLink, int]:
        with self._ready:
            self._ready.wait_for(lambda: self._link is not None or self._stopped)
            return self._link, self._generation

    def _serve(self) -> None:
        while not self._stopped:
            link, generation = self._wait_linked()
            if link is None:
                return
            src = link.upstream
            try:
                tag, message = self.transport.take_any(src, DISPATCH, 0, timeout_s=IDLE_WAIT_S)
            except PeerError as e:   # upstream failed a step's first micro-batch: pass it on to stage 0
                self._forward_error(link, generation, Tag(-1, 0, self.stage, DISPATCH), str(e))
                continue
            except TransportError:
                continue   # idle, or the link was reset
            with self._ready:   # a relink while we waited: what arrived since is for the new link
                link, generation = self._link, self._generation
            if link is None or link.upstream != src:
                self._release(src, tag)
                continue
            try:
                self._serve_step(link, generation, tag, message)
            except TransportError as e:
                self.rejected += 1
                log.warning("stage %d: dropped a step from %s: %s", self.stage, link.upstream, e)
                self.transport.reset(link.upstream)

    def _serve_step(self, link: StageLink, generation: int, tag: Tag, message: torch.Tensor) -> None:
        if tag.micro_batch != 0 or tag.layer != self.stage:
            self._release(link.upstream, tag)
            raise TransportError(f"{tag} does not start a step for stage {self.stage}")
        m = self._micro_batch(link, generation, tag, message, None)
        for mb in range(1, m):
            if self._generation != generation:
                return   # relinked: this step is gone
            tag = Tag(tag.step, mb, self.stage, DISPATCH)
            try:
                message = self.transport.recv(link.upstream, tag, self.timeout_s)
            except PeerError as e:
                self._forward_error(link, generation, tag, str(e))
                raise
            self._micro_batch(link, generation, tag, message, m)

    def _micro_batch(self, link: StageLink, generation: int, tag: Tag, message: torch.Tensor,
                     m: int | None) -> int:
        """Run one micro-batch and send its output on; returns the step's micro-batch count."""
        try:
            try:
                got, plan, x = decode_step(message, self.model.config.hidden_size, self.dtype, self.num_blocks)
                x, context = x.clone(), trace_context(message)   # the slot goes back to upstream before the layers run
            finally:
                self._release(link.upstream, tag)
            if m is not None and got != m:
                raise TransportError(f"micro-batch {tag.micro_batch} says the step has {got}, not {m}")
            with tracing_detail.remote("pipeline.stage", context, stage=self.stage, step=tag.step,
                                       micro_batch=tag.micro_batch, tokens=int(x.shape[0])) as trace:
                self._run(link, generation, tag, plan, x, got, trace)
        except (TransportError, RuntimeError, ValueError, IndexError) as e:
            self._forward_error(link, generation, tag, str(e))
            raise TransportError(str(e)) from e
        return got

    @torch.inference_mode()
    def _run(self, link: StageLink, generation: int, tag: Tag, plan, x: torch.Tensor, m: int,
             trace: tracing_detail.StepTrace | None) -> None:
        """This stage's layers over one micro-batch, then its output on to the next hop."""
        t0 = time.perf_counter()
        out = self._compute(plan, x)
        send = None
        if trace is not None:
            trace.record("pipeline.compute", t0, time.perf_counter(), stage=self.stage, micro_batch=tag.micro_batch)
            send = trace.producer("m2n.send", stage=self.stage, micro_batch=tag.micro_batch)
        try:
            if not self.last:
                out = encode_step(plan, out, m, tracing_detail.words(send))
            self.compute_s += time.perf_counter() - t0
            self.micro_batches += 1
            self.tokens += x.shape[0]
            if self._generation == generation:   # else relinked meanwhile: nobody waits for it
                self.transport.send(link.downstream, self._next_tag(tag), out)
        finally:
            tracing.end(send)

    def _compute(self, plan, x: torch.Tensor) -> torch.Tensor:
        """The hidden states after this stage's layers (the last stage: the logits)."""
        batch = build_forward_batch(plan, self.block_size)
        x = run_layers(self.model, x, batch, self.kv_caches, self.layers)
        if self.last:
            return self.model.compute_logits(final_hidden(self.model, x, batch))
        return x

    def _next_tag(self, tag: Tag) -> Tag:
        """What the next stage expects: stage s + 1's input, or stage 0's logits (COMBINE)."""
        return Tag(tag.step, tag.micro_batch, 0, COMBINE) if self.last else \
            Tag(tag.step, tag.micro_batch, self.stage + 1, DISPATCH)

    def _release(self, src: str, tag: Tag) -> None:
        try:
            self.transport.release(src, tag)
        except TransportError:
            pass   # a reset freed it already

    def _forward_error(self, link: StageLink, generation: int, tag: Tag, reason: str) -> None:
        """Answer `tag`'s next hop with an error, unless stage 0 relinked meanwhile (the
        failed step is gone; an error now would fail its next one)."""
        if self._generation != generation:
            return
        try:
            send_error(self.transport, link.downstream, self._next_tag(tag), f"stage {self.stage}: {reason}")
        except TransportError:
            pass   # downstream is gone too; stage 0's timeout fails the step

    def close(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
        self.transport.close()


def load_shard(config: EngineConfig, stage: StageConfig, transport: Transport | None = None) -> PipelineShard:
    """A later stage as `tessera pipeline-shard --stage i` builds it: only its layers' tensors
    are read (CausalLM.keep_layers) and quantized (--quantization: the whole model's bits, of
    which it applies its own); MemoryBudgetExceeded before any cache is allocated when its
    weights and KV cache exceed --memory-gib. transport: an in-process twin's endpoint."""
    from tessera.engine import resolve_dtype
    from tessera.models.loader import load_model, model_id_for
    from tessera.transport import make_transport, resolve_backend
    if stage.stage == 0:
        raise ConfigError("stage 0 is the pipeline's worker (entrypoints/pipeline_shard.py builds it)")
    check_quantization(config.quantization)
    layers, dtype = stage.range, resolve_dtype(config.dtype)
    model, cfg = load_model(config.model, dtype, prune=lambda m: m.keep_layers(layers), quantization=config.quantization)
    num_blocks, block_size = num_kv_blocks(config.cache, cfg, dtype), config.cache.block_size
    weights = weight_bytes(model)
    check_budget(stage.stage, weights, kv_bytes(cfg, num_blocks, block_size, dtype, layers), stage.memory_gib)
    backend = "local" if transport is not None else resolve_backend(stage.transport)
    if transport is None:
        transport = make_transport(backend, stage.endpoint, slots=SLOTS, capacity_bytes=SLOT_BYTES,
                                   advertise=stage.transport_advertise)
    bits = tuple(stage_bits(config.quantization, cfg.num_layers, config.model)[layers.start:layers.stop])
    return PipelineShard(model, dtype, stage.stage, layers, bits, transport, backend, model_id_for(config.model), num_blocks,
                         block_size, weights, int((stage.memory_gib or 0) * GIB))
