"""What a pipeline stage is: its process's settings (StageConfig, the flags of `tessera
pipeline-shard`), its layer range, and the stage ranges a plan file gives.

A plan file (`tessera plan pq`, or written by hand) is JSON; the runtime reads two fields:
    "bits":   one bit-width per layer (16, 8, 4, 3), read by the loader (--quantization FILE)
    "stages": optional, one object per stage in pipeline order, with its layers [start, end)
              as "start" and "end" (pipeline/plan.py's Plan.to_dict) or "layers": [start, end]
              or "start:end"; the topology takes stage ranges from it when it lists none
Everything else in the file is the planner's business.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from tessera.config import ConfigError


@dataclass(frozen=True)
class StageConfig:
    """One stage process. Stage 0 is a worker: the gateway's entry, with the embedding,
    scheduler, sampler and its own layers; it links the later stages (`shards`) at start-up."""

    stage: int = field(default=0, metadata={"help": "this stage's index in the pipeline (0: the worker)"})
    layers: str = field(default="", metadata={"help": "the decoder layers this stage holds, START:END"})
    name: str = field(default="", metadata={"help": "endpoint name on the M2N transport (default: "
                                                      "pipeline-shard-STAGE)"})
    memory_gib: float | None = field(default=None, metadata={
        "help": "refuse to start when this stage's weights + KV cache exceed this (default: no limit)"})
    transport: str = field(default="auto", metadata={"choices": ("auto", "nixl", "tcp"),
                                                     "help": "M2N backend (auto: nixl where it imports)"})
    transport_advertise: str | None = field(default=None, metadata={
        "help": "host peers dial for the tcp transport (containers, pods); default loopback"})
    shards: tuple[str, ...] = field(default=(), metadata={
        "flag": "--shard", "help": "stage 0: gRPC address of each later stage, in pipeline order"})
    micro_batches: int | None = field(default=None, metadata={
        "help": "stage 0: decode micro-batches per step (default: the stage count)"})
    prefill_micro_batch: int = field(default=1, metadata={
        "help": "stage 0: prefill chunks per micro-batch (LLM-PQ's xi)"})
    timeout_s: float = field(default=10.0, metadata={
        "flag": "--stage-timeout-s", "help": "stage 0: a micro-batch not back from the last stage by "
                                             "then fails the step"})
    connect_wait_s: float = field(default=300.0, metadata={
        "help": "stage 0: how long to wait at start-up for the later stages"})

    def __post_init__(self) -> None:
        layer_range(self.layers)
        if self.stage < 0:
            raise ConfigError("--stage must be >= 0")
        if self.stage and (self.shards or self.micro_batches):
            raise ConfigError("--shard and --micro-batches are stage 0's (the worker's) settings")
        if (self.micro_batches is not None and self.micro_batches < 1) or self.prefill_micro_batch < 1:
            raise ConfigError("--micro-batches and --prefill-micro-batch must be >= 1")
        if self.timeout_s <= 0 or (self.memory_gib is not None and self.memory_gib <= 0):
            raise ConfigError("--stage-timeout-s and --memory-gib must be > 0")

    @property
    def endpoint(self) -> str:
        return self.name or f"pipeline-shard-{self.stage}"

    @property
    def range(self) -> range:
        return layer_range(self.layers)


def layer_range(spec: str) -> range:
    """"START:END" -> range(START, END), START < END."""
    start, sep, end = str(spec).partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit() or int(start) >= int(end):
        raise ConfigError(f"layers {spec!r}: write START:END with START < END, e.g. 0:15", "layers")
    return range(int(start), int(end))


def check_contiguous(ranges: list[range], num_layers: int | None = None) -> None:
    """Stages hold every layer once, in order, from layer 0 (to num_layers when known)."""
    end = 0
    for i, r in enumerate(ranges):
        if r.start != end:
            raise ConfigError(f"stage {i} starts at layer {r.start}, not {end}: stages must cover the "
                              "layers in order, each once")
        end = r.stop
    if num_layers is not None and end != num_layers:
        raise ConfigError(f"the stages end at layer {end}, but the model has {num_layers} layers")


def plan_stages(path: str | pathlib.Path) -> list[str]:
    """The stage ranges ("START:END") a plan file lists (see the module docstring)."""
    try:
        plan = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"plan {path}: {e}") from None
    stages = plan.get("stages") if isinstance(plan, dict) else None
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"plan {path} lists no stages; give the topology's stages their layers")
    out = []
    for s in stages:
        s = s if isinstance(s, dict) else {}
        layers = s.get("layers", [s.get("start"), s.get("end")])
        spec = f"{layers[0]}:{layers[1]}" if isinstance(layers, list) and len(layers) == 2 else str(layers)
        layer_range(spec)
        out.append(spec)
    return out


def check_quantization(quantization: str | None) -> None:
    """Every stage takes the same --quantization and applies its own layers' share of it; a
    GGUF's own Q4 blocks (gguf) are loaded for the whole model at once, so they do not split."""
    if quantization == "gguf":
        raise ConfigError("--quantization gguf does not split into pipeline stages; use int8, int4, int3 or a "
                          "plan file", "quantization")


def stage_bits(quantization: str | None, num_layers: int, model: str | None = None) -> list[int]:
    """The bit-width of every layer of the model under --quantization (16: dense); a quantized
    checkpoint (`tessera quantize`, e.g. GPTQ's codes) says its own, as it is loaded with none."""
    from tessera.layers.quant import parse_quantization
    check_quantization(quantization)
    if model is not None and not quantization:
        from tessera.models import quantized_checkpoint
        from tessera.models.loader import resolve_model_path
        path = resolve_model_path(model)
        if quantized_checkpoint.is_quantized_checkpoint(path):
            return quantized_checkpoint.manifest_bits(path)
    return parse_quantization(quantization, num_layers) or [16] * num_layers
