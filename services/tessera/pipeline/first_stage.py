"""Build stage 0's engine: its layers of the model (the embedding, no head unless it is the
only stage), a transport endpoint linked into the ring of later stages over the control plane
(pipeline/control.py), and a PipelineRunner. The scheduler, KV block manager, sampler and
detokenizer are the ordinary Engine's: a pipeline is a worker with another runner."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Callable

from tessera.config import ConfigError, EngineConfig
from tessera.engine import Engine, resolve_dtype
from tessera.models.loader import load_model, model_id_for
from tessera.pipeline.control import StageControl, StageInfo, StageLink, StageRefused
from tessera.pipeline.memory import check_budget, kv_bytes, num_kv_blocks, weight_bytes
from tessera.pipeline.runner import PipelineRunner
from tessera.pipeline.shard import SLOT_BYTES, SLOTS
from tessera.pipeline.stages import StageConfig, check_contiguous, check_quantization, stage_bits
from tessera.transport import make_transport, resolve_backend
from tessera.transport.base import TransportError
from tessera.worker_api import Unavailable

log = logging.getLogger("tessera.pipeline")


class Ring:
    """Stage 0's view of the later stages: their controls, and linking them into the ring
    0 -> 1 -> ... -> N-1 -> 0 (again after a failure: `link(wait_s=0)`)."""

    def __init__(self, transport, controls: list[StageControl], template: StageLink) -> None:
        self.transport, self.controls, self.template = transport, controls, template
        self.names: list[str] = []      # endpoint names of stages 1 .. N-1

    def link(self, wait_s: float = 0.0) -> None:
        """Link every stage (waiting up to wait_s for each to answer). A stage that cannot be
        reached raises TransportError (a lost peer: the step's requests may go to another
        replica); one that does not fit this pipeline, StageRefused."""
        try:
            self._link(wait_s)
        except Unavailable as e:
            raise TransportError(f"pipeline stage unreachable: {e}") from e

    def _link(self, wait_s: float) -> None:
        infos = [_wait_info(c, wait_s) for c in self.controls]
        t = self.template
        ranges = [range(*t.layers)] + [range(*i.layers) for i in infos]
        try:
            check_contiguous(ranges, t.num_layers)
        except ConfigError as e:
            raise StageRefused(f"pipeline layers {[f'{r.start}:{r.stop}' for r in ranges]}: {e}") from None
        names = [self.transport.name] + [i.stage for i in infos]
        n = len(names)
        if len(set(names)) != n:
            raise StageRefused(f"pipeline stages need distinct endpoint names (--name), not {names}")
        links = [replace(t, stage_index=k, stage_count=n, layers=(ranges[k].start, ranges[k].stop),
                         bits=t.bits[ranges[k].start:ranges[k].stop], upstream=names[k - 1],
                         downstream=names[(k + 1) % n]) for k in range(1, n)]
        # Round 1: every stage drops its old link and says its metadata for each neighbour.
        metadata = {names[k]: c.connect(link).metadata for k, (c, link) in enumerate(zip(self.controls, links), 1)}
        for peer in dict.fromkeys([names[1], names[-1]]):
            self.transport.reset(peer)       # what a failed step left from them
            self.transport.connect(peer, metadata[peer][names[0]])

        def of(a: str, b: str) -> bytes:     # a's metadata for b
            return self.transport.metadata_for(b) if a == names[0] else metadata[a][b]
        for c, link in zip(self.controls, links):   # round 2: neighbours' metadata; the stages serve
            c.connect(replace(link, peer_metadata={p: of(p, names[link.stage_index]) for p in
                                                   dict.fromkeys([link.upstream, link.downstream])}))
        self.names = names[1:]
        log.info("pipeline linked: %s", " -> ".join(f"{name} [{r.start}:{r.stop})" for name, r in zip(names, ranges)))

    def watch(self, on_broken: Callable[[], None], interval_s: float = 1.0) -> None:
        """Poll the stages in a daemon thread and call on_broken() when one does not answer or
        is not linked to this stage 0 (it restarted while no request was running), so that the
        next step relinks first instead of failing on the dead link."""
        def loop() -> None:
            while True:
                time.sleep(interval_s)
                for control in self.controls:
                    try:
                        linked = control.info().pipeline == self.template.pipeline
                    except Exception:   # Unavailable, or anything else the channel raises
                        linked = False
                    if not linked:
                        on_broken()
                        break
        threading.Thread(target=loop, name="pipeline-watch", daemon=True).start()


def _wait_info(control: StageControl, wait_s: float) -> StageInfo:
    """A stage's info, waiting up to wait_s while it starts."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return control.info()
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def build_first_stage(config: EngineConfig, stage: StageConfig, controls: list[StageControl],
                      transport=None, tokenizer=None) -> Engine:
    """Stage 0's engine, linked to its later stages (controls, in pipeline order). Raises
    MemoryBudgetExceeded before allocating the KV cache, StageRefused when the stages do not
    form this pipeline (layers, precision, model, cache), TransportError when one never answers.
    transport: an in-process twin's endpoint."""
    if config.speculative.draft is not None:
        raise ConfigError("speculative decoding does not run in a pipeline", "speculative")
    if stage.stage != 0:
        raise ConfigError("only stage 0 builds the pipeline's engine")
    check_quantization(config.quantization)
    layers, dtype = stage.range, resolve_dtype(config.dtype)
    model, cfg = load_model(config.model, dtype, prune=lambda m: m.keep_layers(layers), quantization=config.quantization)
    num_blocks, block_size = num_kv_blocks(config.cache, cfg, dtype), config.cache.block_size
    check_budget(0, weight_bytes(model), kv_bytes(cfg, num_blocks, block_size, dtype, layers), stage.memory_gib)
    if not controls and layers.stop != cfg.num_layers:
        raise ConfigError(f"stage 0 holds layers {stage.layers} and there are no later stages "
                          f"(--shard) for the rest of the model's {cfg.num_layers}")
    backend = "local" if transport is not None else resolve_backend(stage.transport)
    if transport is None and controls:
        logits = config.scheduler.max_num_seqs * cfg.vocab_size * 4   # the most a micro-batch sends back
        transport = make_transport(backend, stage.endpoint, slots=SLOTS, capacity_bytes=max(SLOT_BYTES, logits),
                                   timeout_s=stage.timeout_s, advertise=stage.transport_advertise)
    template = StageLink(transport.name if transport is not None else stage.endpoint, backend, model_id_for(config.model), cfg.num_layers, 0, 1,
                         (layers.start, layers.stop), tuple(stage_bits(config.quantization, cfg.num_layers, config.model)),
                         str(dtype).removeprefix("torch."), num_blocks, block_size, "", "")
    ring = Ring(transport, controls, template)
    if controls:
        ring.link(stage.connect_wait_s)

    def make_runner(m, nb, bs):
        return PipelineRunner(m, nb, bs, layers, transport, ring.names, stage.micro_batches,
                              stage.prefill_micro_batch, stage.timeout_s, ring.link)
    # An explicit block count: the one every stage sized its cache with (checked when linking).
    engine_config = replace(config, cache=replace(config.cache, num_blocks=num_blocks))
    engine = Engine(engine_config, model, tokenizer, make_runner=make_runner)
    if controls:
        def broken() -> None:     # a stage that restarted lost its KV: no cached prefix may be shared
            engine.reset_prefix_cache()
            engine.runner.request_resync()
        ring.watch(broken)
    return engine
