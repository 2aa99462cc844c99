"""Frozen configuration dataclasses, validated on construction.

Every process builds its runtime from these; the CLI maps its flags onto their fields.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


INT32_MAX = 2**31 - 1            # protobuf int32 fields: token ids, top_k, max/min_tokens
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38   # protobuf float fields: a larger value arrives as inf
SAMPLING_EPS = 1e-5              # vLLM's _SAMPLING_EPS: a temperature below it is greedy


class ConfigError(ValueError):
    """A configuration or request parameter is invalid; the message says which and why, and
    `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (structured/grammars.py compiles it): kind "json" (value: a
    JSON Schema as JSON text), "json_object" (any JSON object; value unused), "regex", "choice"
    (value: a JSON list of strings) or "grammar" (a Lark grammar, llguidance's syntax). param:
    the request field it came from, named by the error a bad one gets."""

    kind: str
    value: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ConfigError(f"structured output kind {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}",
                              self.param)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; a temperature below SAMPLING_EPS (0 included) means greedy, as
    vLLM's sampler decides: logits divided by 1e-39 overflow to inf (NaN probabilities).

    Ranges are OpenAI's, widened where vLLM accepts more: temperature >= 0 (OpenAI: <= 2),
    logprobs up to 20 (OpenAI's completions: 5), and vLLM's extensions top_k, min_p,
    repetition_penalty, min_tokens. top_p 0 (OpenAI's range; vLLM wants > 0) keeps the most
    likely token. Every float must be finite, and finite as a 32-bit float: it travels to the
    worker as a protobuf float."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16   # None: up to the end of the context
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) pairs
    cache_salt: str | None = None   # prefix-cache namespace: different salts never share KV blocks
    structured: StructuredOutput | None = None   # a grammar the output must match (masked decoding)

    def __post_init__(self) -> None:
        """Everything that can be checked without the model; the worker checks token ids
        against the vocabulary at admission (Engine.add_request)."""
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in floats:
            if not -FLOAT32_MAX <= getattr(self, name) <= FLOAT32_MAX:    # NaN fails it too
                raise ConfigError(f"{name} must be a finite number", name)
        checks = [
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 <= self.top_p <= 1.0, "top_p", "must be in [0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must fit in 64 bits"),
            (self.top_k <= INT32_MAX, "top_k", f"must be <= {INT32_MAX}"),
            (self.max_tokens is None or self.max_tokens <= INT32_MAX, "max_tokens", f"must be <= {INT32_MAX}"),
            (self.min_tokens <= INT32_MAX, "min_tokens", f"must be <= {INT32_MAX}"),
            (all(0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
             "must be token ids (integers >= 0)"),
            (all(0 <= t <= INT32_MAX for t, _ in self.logit_bias), "logit_bias",
             "keys must be token ids (integers >= 0)"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias",
             "values must be in [-100, 100]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ConfigError(f"{name} {why}", name)
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty", "stop")
        if self.cache_salt == "":
            raise ConfigError("cache_salt must be a non-empty string when given", "cache_salt")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks; num_blocks None = sized from kv_cache_gib; automatic
    prefix caching on unless disabled (--no-enable-prefix-caching)."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    num_blocks: int | None = field(default=None, metadata={
        "flag": "--num-kv-blocks", "help": "KV blocks to allocate (default: as many as --kv-cache-gib holds)"})
    kv_cache_gib: float = field(default=1.0, metadata={"help": "memory for the KV cache, GiB"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": ("auto", "int8"),
        "help": "auto: the model's dtype; int8: values with a float32 scale per token and KV head (about twice "
        "the blocks in the same memory, faster long-context decode attention)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "share the KV of full blocks whose whole prefix an earlier request computed (vLLM's APC); "
        "outputs are the same either way"})

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError("num_blocks must be > 0")
        if self.kv_cache_gib <= 0:
            raise ConfigError("kv_cache_gib must be > 0")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ConfigError("kv_cache_dtype must be auto or int8", "kv_cache_dtype")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: tokens per step (chunked prefill) and running requests."""

    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "tokens per engine step (longer prompts are prefilled in chunks); 2048, as vLLM's "
                "server uses"})
    max_num_seqs: int = field(default=128, metadata={"help": "requests running at once"})
    max_waiting: int = field(default=1024, metadata={
        "help": "queued requests before the worker answers Saturated (HTTP 503)"})
    max_queue_delay_ms: float = field(default=0.0, metadata={
        "help": "an idle engine's first step waits up to this long for more requests to join it, "
                "or until max_num_seqs are waiting (Triton's dynamic batching max_queue_delay): an "
                "offline batch sent at once is prefilled together, not split by arrival; 0: step at once"})

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be > 0")
        if self.max_waiting < 0:
            raise ConfigError("max_waiting must be >= 0")
        if not 0 <= self.max_queue_delay_ms <= 10_000:
            raise ConfigError("max_queue_delay_ms must be in [0, 10000]")


DRAFT_QUANTIZATIONS = {"": 16, "int8": 8, "int4": 4}   # --speculative D@Q: Q -> weight bits


@dataclass(frozen=True)
class SpeculativeConfig:
    """Tree speculative decoding (SwiftSpec): who drafts, and the shape of each round's tree."""

    draft: str | None = field(default=None, metadata={
        "flag": "--speculative", "help": "drafter: 'self:K' (the target's first K layers), 'self@int4' or 'self@int8' (a copy of the target with int4 or int8 weights), 'ngram' (prompt lookup), "
        "or a model (HF directory, .gguf, 'smollm2'; @int4 or @int8: quantized); default: no speculation"})
    draft_address: str | None = field(default=None, metadata={
        "help": "gRPC address of a draft worker (disaggregated); default: draft in this process (serial)"})
    tree_size: int = field(default=8, metadata={
        "flag": "--spec-tree-size", "help": "bs: tree nodes verified per round, root included"})
    width: int = field(default=4, metadata={
        "flag": "--spec-width", "help": "w: leaves the draft expands per forward"})
    branching: int = field(default=4, metadata={
        "flag": "--spec-branching", "help": "children the draft keeps under each expanded node"})
    depth: int = field(default=3, metadata={
        "flag": "--spec-depth", "help": "d: draft expansions per round (profile: t_target / t_draft)"})
    disable_batch_size: int = field(default=4, metadata={
        "flag": "--spec-disable-batch-size",
        "help": "above this many running requests, decode plainly (speculation pays at small batch)"})

    def __post_init__(self) -> None:
        if min(self.tree_size, self.width, self.branching, self.disable_batch_size) < 1 or self.depth < 0:
            raise ConfigError("spec tree size, width, branching and disable batch size must be >= 1, depth >= 0")
        # what can be checked without loading a model, so a typo fails `tessera serve` at once
        # instead of a draft worker that exits and restarts
        name, _, quant = (self.draft or "").partition("@")
        if quant not in DRAFT_QUANTIZATIONS:
            raise ConfigError(f"unknown draft quantization {quant!r} (int8 and int4 are supported)", "speculative")
        if name.startswith("self:") and not name.removeprefix("self:").isdigit():
            raise ConfigError("self:K needs an integer K", "speculative")


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="smollm2", metadata={
        "help": "'smollm2' (default), random:ARCH, an HF directory or a .gguf file"})
    dtype: str = field(default="auto", metadata={
        "choices": ("auto", "float32", "bfloat16"),
        "help": "auto: bfloat16 where the CPU has AMX, AVX512-BF16, or AVX-512 or AVX2 with FMA (bf16 register tiles), else float32"})
    quantization: str | None = field(default=None, metadata={
        "help": "weight-only quantized linears: int8, int4 (group 32), int3, gguf (serve a GGUF's own Q4 "
        "blocks), or a plan JSON with per-layer 'bits' (tessera plan pq); default: dense"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + completion (default: the model's)"})
    num_threads: int | None = field(default=None, metadata={
        "flag": "--threads", "help": "torch CPU threads (default: torch's choice)"})
    pin_threads: bool = field(default=True, metadata={
        "help": "a worker holding every core (no --threads, one torch thread per core) pins its threads one per "
        "core (cpu_pinning.py); --no-pin-threads leaves them to the OS"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "run every step through Python: no replayed decode steps (step_graph.py)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a token's logits bitwise the same whatever the batch around it, the chunking, prefill or decode and "
        "tree verification (docs/engine.md#batch-invariant-mode): the linears run on one kernel at every row count "
        "and the attention a row at a time; replicas fail over only to the same CPU kernel path"})
    graph_warmup_s: float = field(default=5.0, metadata={
        "help": "seconds a worker's warm-up may spend recording the step graphs of prompt steps (32, 48, ... "
        "tokens, then 1-16) before it says ready; 0: each is recorded at its first step (step_graph.py)"})
    # Read from the environment, against the rule, so that the test suite can check every engine it
    # builds, in its own process and in the `tessera` processes it starts.
    replay_check_every: int = field(default_factory=lambda: int(os.environ.get("TESSERA_REPLAY_CHECK_EVERY", "0")),
                                    metadata={"help": "check every Nth replayed step against the eager step too; a "
                                              "graph that differs is logged, counted and dropped (0: only each graph's "
                                              "first replay; default: $TESSERA_REPLAY_CHECK_EVERY or 0)"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError("dtype must be auto, float32 or bfloat16")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len must be > 0")
        if not self.graph_warmup_s >= 0:
            raise ConfigError("graph_warmup_s must be >= 0", "graph_warmup_s")
        if self.replay_check_every < 0:
            raise ConfigError("replay_check_every must be >= 0", "replay_check_every")
        q = self.quantization
        if q not in (None, "int8", "int4", "int3", "gguf") and not (q.endswith(".json")):
            raise ConfigError("quantization must be int8, int4, int3, gguf or a plan .json file", "quantization")


@dataclass(frozen=True)
class AfdConfig:
    """An attention node of an attention-FFN disaggregated deployment."""

    name: str = "attention-0"                 # its endpoint name on the M2N transport
    expert_nodes: tuple[str, ...] = ()        # gRPC addresses of the expert nodes, in shard order
    transport: str = "auto"                   # nixl where it imports, else tcp
    micro_batches: int = 2                    # ping-pong depth m; 1 turns the pipeline off
    timeout_s: float = 10.0                   # an expert reply later than this fails the step
    connect_wait_s: float = 300.0             # how long to wait for expert nodes at start-up
    transport_advertise: str | None = None    # host the experts dial back (tcp), when not loopback

    def __post_init__(self) -> None:
        if not self.expert_nodes:
            raise ConfigError("an attention node needs at least one expert node")
        if self.micro_batches < 1:
            raise ConfigError("micro_batches must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError("timeout_s must be > 0")
