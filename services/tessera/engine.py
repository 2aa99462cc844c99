"""The engine loop: schedule -> run -> postprocess, synchronous and single-threaded.

add_request() validates (the only place a request is checked) and queues; step() runs one scheduler step and returns a
RequestOutput (new tokens, new text, logprobs, finish reason) for every request that
produced something. abort() frees a request's blocks at once.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from tessera import batch_invariant
from tessera.config import ConfigError, EngineConfig, SamplingParams
from tessera.detokenizer import IncrementalDetokenizer
from tessera.kv_cache import KVCacheManager
from tessera.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_dtype
from tessera.models.loader import load_model, model_id_for
from tessera.request import Request, RequestStatus, RequestTimings, Resume
from tessera.sampler import SampleResult, SamplingBatch, sample
from tessera.scheduler import ScheduledRequest, Scheduler
from tessera.spec.acceptance import accept
from tessera.spec.proposer import Proposer, make_proposer
from tessera.spec.stats import SpecStats
from tessera.spec.tree import Draft
from tessera.structured import masks
from tessera.structured.grammars import Grammars
from tessera_kernels import cbuild, tile_linear

log = logging.getLogger("tessera.engine")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None          # set when this request failed inside the engine
    accepted_tokens: int = 0          # speculative decoding: draft tokens accepted so far
    rejected_tokens: int = 0          # and verified but rejected so far
    cached_tokens: int = 0            # prompt tokens the prefix cache served (OpenAI's cached_tokens)
    timings: RequestTimings | None = None   # a request's last output, when it ended normally


class EngineError(RuntimeError):
    pass


class QueueFull(EngineError):
    """The waiting queue is at max_waiting: back-pressure (HTTP 503 with Retry-After)."""


def resolve_dtype(name: str) -> torch.dtype:
    """'auto' picks bfloat16 where its linears run at least at float32's speed: where the CPU
    multiplies bf16 natively (AMX or AVX512-BF16), or where the bf16 register tiles are built
    for its float32 FMAs (AVX-512 or AVX2 with FMA). There the products cost what float32's do
    and the weights and KV cache cross memory at half the bytes, so small-batch decode, which
    is bound by those bytes, is faster in bf16 and large batches and prompts are no slower.
    Else (no FMA vectors, no compiler)
    float32: bf16 would go to torch's emulation. vLLM's own 'auto' is another rule (vllm_backend:
    its bf16 is emulated without AMX or AVX512-BF16)."""
    if name == "auto":
        native = cbuild.cpu_flags() & {"amx_bf16", "avx512_bf16"}
        name = "bfloat16" if native or tile_linear.available(torch.bfloat16) else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class Engine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, make_runner=ModelRunner,
                 proposer: Proposer | None = None) -> None:
        """make_runner(model, num_blocks, block_size) builds the runner (AFD swaps in its own);
        proposer: where draft trees come from (default: from config.speculative, or none)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype)
        if model is None:
            model, _ = load_model(config.model, self.dtype, quantization=config.quantization)
        if config.batch_invariant:
            batch_invariant.apply(model, self.dtype, config.quantization)
        if tokenizer is None:
            from tessera.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.model_config = model.config
        self.model_id = model_id_for(config.model)
        self.tokenizer = tokenizer
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        if config.max_model_len and config.max_model_len > limit:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's {limit}")
        cache = config.cache
        kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, self.dtype)
        if kv_dtype != self.dtype and make_runner is not ModelRunner:
            raise ConfigError("--kv-cache-dtype int8 runs on the monolithic engine; attention nodes and "
                              "pipeline stages keep a cache of the model's dtype", "kv_cache_dtype")
        per_block = kv_bytes_per_block(self.model_config, cache.block_size, kv_dtype)
        num_blocks = cache.num_blocks or max(1, int(cache.kv_cache_gib * 2**30 // per_block))
        prefix_caching = cache.enable_prefix_caching and not self.model_config.rope_depends_on_prompt
        if prefix_caching != cache.enable_prefix_caching:
            log.info("prefix caching off: this model's RoPE scaling rotates each token by its request's "
                     "prompt length, so one prompt's KV blocks are not another's")
        self.kv = KVCacheManager(num_blocks, cache.block_size, prefix_caching)
        self._reset_prefix_cache = False
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = (make_runner(model, num_blocks, cache.block_size) if kv_dtype == self.dtype
                       else ModelRunner(model, num_blocks, cache.block_size, kv_dtype=kv_dtype))
        if not config.enforce_eager and getattr(self.runner, "step_graphs_apply", False):
            self.runner.replay_steps(-(-self.max_model_len // cache.block_size),
                                    config.scheduler.max_num_batched_tokens, config.replay_check_every)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.grammars = Grammars(tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._default_generator = torch.Generator().manual_seed(0)
        self._ids = itertools.count()
        self.proposer = proposer or make_proposer(config.speculative, model, self.dtype, self.max_model_len)
        self.spec_stats = SpecStats()
        self._draft_warned = float("-inf")

    @functools.cached_property
    def compat_hash(self) -> str:
        """The compatibility hash this engine registers with (registry.compatibility_hash)."""
        from tessera.registry import compatibility_hash
        vocab = sorted(self.tokenizer.get_vocab().items())
        template = getattr(self.tokenizer, "chat_template", None) or ""
        tokenizer = hashlib.sha256(repr((vocab, template)).encode()).hexdigest()[:16]
        dtype = str(self.dtype).removeprefix("torch.")
        if self.config.quantization:   # a plan file is named by its contents: two plans may differ
            dtype += "+" + _quantization_digest(self.config.quantization)
        if self.config.batch_invariant:
            dtype += "+invariant:" + batch_invariant.kernel_path(self.dtype)
        return compatibility_hash(self.model_id, dtype, tokenizer)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, resume: Resume | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue: the one place a request is checked against this engine (token
        ids against the vocabulary, lengths against the context and the KV cache, the queue
        bound), so nothing that enters a batch can make a step raise. Raises ConfigError
        (ContextLengthError) for a bad request, QueueFull when the queue is full.
        arrival_time: when the worker had it tokenized (time.monotonic(); default: now)."""
        request_id = request_id or f"req-{next(self._ids)}"
        resume = resume or Resume()
        # a resumed request's output so far counts toward max_tokens: limits are the prompt's alone
        sampling = self.resolve(len(prompt_token_ids), sampling)
        if len(resume.output_token_ids) >= sampling.max_tokens:
            raise ConfigError(f"resume: {len(resume.output_token_ids)} tokens already generated, "
                              f"max_tokens is {sampling.max_tokens}", "max_tokens")
        self._check_token_ids(prompt_token_ids, sampling, resume)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFull("the worker's queue is full; retry later")
        if request_id in self.scheduler.requests:
            raise ConfigError(f"request id {request_id} is already running", "request_id")
        grammar = self._grammar(sampling, resume)
        request = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids,
                          output_token_ids=list(resume.output_token_ids), grammar=grammar)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sampling.stop,
                                       sampling.include_stop_str_in_output)
        detok.resume(resume.output_token_ids, resume.text_sent)
        self._detok[request_id] = detok
        return request_id

    def _check_token_ids(self, prompt: list[int], sampling: SamplingParams, resume: Resume) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (("prompt", prompt), ("stop_token_ids", sampling.stop_token_ids),
                          ("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("prompt", resume.output_token_ids)):
            if any(not 0 <= t < vocab for t in ids):
                raise ConfigError(f"{name}: token ids must be in [0, {vocab}) for this model", name)

    def _grammar(self, sampling: SamplingParams, resume: Resume):
        """A structured output's matcher, advanced past what a failed-over request had generated."""
        if sampling.structured is None:
            return None
        grammar = self.grammars.matcher(sampling.structured)
        if resume.output_token_ids and not grammar.consume_tokens(list(resume.output_token_ids)):
            raise ConfigError("resume: the tokens already generated do not follow the structured output",
                              sampling.structured.param)
        return grammar

    def resolve(self, num_tokens: int, sampling: SamplingParams) -> SamplingParams:
        """The request's sampling with max_tokens=None made concrete: as much as both the
        context and the KV cache can hold (vLLM's rule; reaching it finishes with "length").
        num_tokens counts the prompt (a resumed request's output counts toward max_tokens). Raises
        ConfigError when the request can never run here."""
        if num_tokens == 0:
            raise ConfigError("the prompt is empty", "prompt")
        capacity = self.kv.num_blocks * self.kv.block_size
        if sampling.max_tokens is None:
            room = min(self.max_model_len, capacity) - num_tokens
            if room < 1:
                raise ContextLengthError(self._too_long(num_tokens, 1))
            sampling = replace(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))
        total = num_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(self._too_long(num_tokens, sampling.max_tokens))
        if total > capacity:
            raise ContextLengthError(f"{total} tokens do not fit in the KV cache of this worker "
                                     f"({capacity} tokens)")
        return sampling

    def _too_long(self, num_tokens: int, max_tokens: int) -> str:
        return (f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_tokens + max_tokens} tokens ({num_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget_draft(request_id)
        self._forget(request_id)
        return request is not None

    def fail_running(self) -> list[str]:
        """After a step raised: abort every running request (its KV state is suspect) and
        return their ids; waiting requests stay queued. The prefix cache is dropped too: a
        failed step may mean a runner lost KV (a pipeline stage restarted)."""
        ids = [r.request_id for r in list(self.scheduler.running)]
        for rid in ids:
            self.abort(rid)
        self.kv.reset_prefix_cache()
        return ids

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next step (any thread may ask: a pipeline
        stage was seen restarted, its KV gone)."""
        self._reset_prefix_cache = True

    def step(self) -> list[RequestOutput]:
        if self._reset_prefix_cache:
            self._reset_prefix_cache = False
            self.kv.reset_prefix_cache()
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        logits = self.runner.execute(plan)
        self.scheduler.on_step_done(plan)
        plain: list[int] = []
        trees: list[tuple[ScheduledRequest, int]] = []
        row = 0
        for entry in (e for e in plan.scheduled if e.sample):
            (trees.append((entry, row)) if entry.tree_parents else plain.append(row))
            row += len(entry.token_ids) if entry.tree_parents else 1
        requests = [self.scheduler.requests[e.request_id] for e in plan.scheduled if e.sample and not e.tree_parents]
        plain_logits = logits[:len(plain)] if plain == list(range(len(plain))) else logits[plain]  # no copy when in order
        outputs = self._sample_rows(requests, plain_logits) if requests else []
        outputs += [self._verify(entry, logits[r:r + len(entry.token_ids)]) for entry, r in trees]
        self._propose(outputs)
        return outputs

    def _sample_rows(self, requests: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the rows as one batch, then postprocess each row exactly once (a row whose
        postprocessing raises fails alone). Validation should make sampling's failure
        unreachable; if the batch's still raises, its rows are sampled one by one."""
        try:
            result = sample(logits, self._sampling_batch(requests), self._default_generator)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(requests))
            return [self._sample_alone(r, logits[i:i + 1]) for i, r in enumerate(requests)]
        return [self._postprocess(r, i, result) for i, r in enumerate(requests)]

    def _verify(self, entry: ScheduledRequest, logits: torch.Tensor) -> RequestOutput:
        """One request's draft tree, verified by spec/acceptance.accept: each node's token is
        drawn by the same sampler and postprocessing as plain decoding at that position, then
        the accepted nodes' KV moves to where plain decoding would have put it."""
        request = self.scheduler.requests[entry.request_id]
        draft = Draft(entry.token_ids[1:], entry.tree_parents)
        outs: list[RequestOutput] = []

        def draw(node: int) -> int | None:
            outs.append(self._sample_alone(request, logits[node:node + 1]))
            return None if outs[-1].finished else outs[-1].new_token_ids[-1]
        path = accept(draft, draw)
        request.accepted_tokens += len(path)
        request.rejected_tokens += len(draft) - len(path)
        self.spec_stats.count(len(draft), len(path), len(outs))
        if not outs[-1].finished:
            self.runner.keep_path(entry.block_table, entry.start_pos, path)
            self.scheduler.advance(request, len(path))
        last = outs[-1]
        return replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                       new_text="".join(o.new_text for o in outs), logprobs=[lp for o in outs for lp in o.logprobs],
                       accepted_tokens=request.accepted_tokens, rejected_tokens=request.rejected_tokens)

    def _propose(self, outputs: list[RequestOutput]) -> None:
        """Ask the proposer for each running request's next draft tree, while the batch is
        small enough for speculation to pay; a proposer failure only means plain decoding."""
        if self.proposer is None:
            return
        spec = self.config.speculative
        on = len(self.scheduler.running) <= spec.disable_batch_size
        for out in outputs:
            request = self.scheduler.requests.get(out.request_id)
            if request is None or out.finished:
                self._forget_draft(out.request_id)
                continue
            fits = request.num_tokens + spec.tree_size <= self.max_model_len
            if not on or not fits:      # plain this round; the proposer keeps its state for later
                request.draft = None
                continue
            new = request.num_tokens - request.spec_synced if request.spec_synced else request.num_tokens
            try:
                draft = self.proposer.propose(request.request_id, request.all_token_ids, new, spec.tree_size)
                request.spec_synced = request.num_tokens
                if draft is not None:       # whoever drafted, the target checks what it verifies
                    draft.check_vocab(self.model_config.vocab_size)
            except Exception as e:   # the draft worker is gone or broken: decode plainly
                if time.monotonic() - self._draft_warned > 10.0:   # one line per 10 s, not per step
                    self._draft_warned = time.monotonic()
                    log.warning("request %s: no draft this round, decoding plainly (%s)", request.request_id, e)
                self._forget_draft(out.request_id, request)
                continue
            request.draft = draft if draft and len(draft) < spec.tree_size else None

    def _forget_draft(self, request_id: str, request: Request | None = None) -> None:
        if request is not None:
            request.draft, request.spec_synced = None, 0
        if self.proposer is not None:
            try:
                self.proposer.finish(request_id)
            except Exception as e:
                log.warning("request %s: draft finish failed (%s)", request_id, e)

    def _sample_alone(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        """One row sampled and postprocessed on its own (a tree node, or after the batch's
        sampling failed): it fails alone."""
        try:
            result = sample(logits, self._sampling_batch([request]), self._default_generator)
        except Exception as e:
            return self._fail(request, "sampling", e)
        return self._postprocess(request, 0, result)

    def _fail(self, request: Request, what: str, e: Exception) -> RequestOutput:
        """Abort one request that raised inside a step (the others go on); its output carries the error."""
        log.exception("request %s: %s failed", request.request_id, what)
        self.abort(request.request_id)
        return RequestOutput(request.request_id, [], "", [], True, "abort", request.num_prompt_tokens,
                             request.num_output_tokens, error=f"{what} failed: {type(e).__name__}: {e}",
                             accepted_tokens=request.accepted_tokens, rejected_tokens=request.rejected_tokens,
                             cached_tokens=max(request.num_cached_tokens, 0))

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        banned = []
        for r in requests:
            sp = r.sampling
            early = r.num_output_tokens < sp.min_tokens
            banned.append(tuple(sp.stop_token_ids) + tuple(self.eos_token_ids) if early else ())
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        return SamplingBatch(
            params=[r.sampling for r in requests],
            output_ids=[r.output_token_ids for r in requests],
            prompt_ids=[r.prompt_token_ids for r in requests],
            banned_ids=banned, grammar_rows=rows,
            grammar_mask=masks.fill([requests[i].grammar for i in rows], self.model_config.vocab_size)
            if rows else None)

    def _postprocess(self, request: Request, row: int, result: SampleResult) -> RequestOutput:
        """Row `row` of a sample as the request's next token (detokenized, stop-checked, with
        logprobs); a request whose postprocessing raises fails alone."""
        try:
            return self._append_token(request, row, result)
        except Exception as e:
            return self._fail(request, "postprocessing", e)

    def _append_token(self, request: Request, row: int, result: SampleResult) -> RequestOutput:
        token = result.token_ids[row]
        request.append_output(token)
        detok = self._detok[request.request_id]
        status = RequestStatus.FINISHED_STOPPED if detok.append(token) else request.check_stop_token()
        if request.grammar is not None and status is None:
            if not request.grammar.consume_token(token):
                raise RuntimeError(f"the structured output refused token {token}: {request.grammar.get_error()}")
            if request.grammar.is_stopped():    # nothing may follow: done without waiting for EOS
                status = RequestStatus.FINISHED_STOPPED
        logprobs = []
        if request.sampling.logprobs is not None:
            k = request.sampling.logprobs
            top = list(zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist())) if k else []
            logprobs.append(TokenLogprob(token, float(result.logprobs[row]), top))
        timings = None
        if status is not None:
            self.scheduler.finish(request.request_id, status)
            self._forget(request.request_id)
            timings = request.timings(time.monotonic())
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[token],
            new_text=detok.delta(finished=status is not None), logprobs=logprobs,
            finished=status is not None, finish_reason=status.value if status else None,
            prompt_tokens=request.num_prompt_tokens, completion_tokens=request.num_output_tokens,
            accepted_tokens=request.accepted_tokens, rejected_tokens=request.rejected_tokens,
            cached_tokens=max(request.num_cached_tokens, 0), timings=timings)

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Offline: run prompts to completion and return each one's output token ids."""
        ids = [self.add_request(p, sampling) for p in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[i] for i in ids]


def _quantization_digest(spec: str) -> str:
    import pathlib
    path = pathlib.Path(spec)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else spec


class ContextLengthError(ConfigError):
    """Prompt plus max_tokens exceed what this engine can hold (OpenAI: context_length_exceeded)."""
