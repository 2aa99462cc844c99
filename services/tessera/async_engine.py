"""AsyncEngine: the engine loop in its own thread, with an asyncio face.

The thread owns the Engine (nothing else touches it): it drains an inbox of add/abort
commands, runs step(), and hands each RequestOutput to the waiting coroutine through
loop.call_soon_threadsafe. Every accepted request ends with a finished output or an error.
A stream that falls behind gets the outputs waiting for it merged into one chunk.

Given a builder instead of an Engine, the thread builds the engine itself, so that one thread
runs every OpenMP parallel region of the process: libgomp keeps a team of threads per thread
that starts regions, and once a process holds more of them than it has CPUs, it cuts the
time its threads spin at a barrier to almost nothing, so every region pays a sleep and a
wake-up, and a small decode step, made of many short regions, becomes markedly slower.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

from tessera.config import ConfigError, StructuredOutput
from tessera.engine import ContextLengthError, Engine, QueueFull, RequestOutput
from tessera.processor import Processor
from tessera.transport.base import TransportError
from tessera.worker_api import (ContextLengthExceeded, GenerateChunk, GenerateInput, InternalError,
                                InvalidRequest, Saturated, TokenLogprobInfo, TopToken, Unavailable,
                                WorkerError, WorkerInfo)

log = logging.getLogger("tessera.engine")


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine], role: str = "worker") -> None:
        """engine: a built Engine, or a builder the loop thread calls first (returns once
        it is built; its failure is raised here)."""
        self.role = role
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0
        self.last_step = time.monotonic()
        self.error: BaseException | None = None
        self._stop = False
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="engine-loop", daemon=True)
        self._thread.start()
        outcome = built.get()
        if isinstance(outcome, BaseException):
            raise outcome
        self.engine: Engine = outcome
        self.processor = Processor(outcome.tokenizer)
        self.compat = outcome.compat_hash

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def info(self) -> WorkerInfo:
        e, spec, graphs = self.engine, self.engine.spec_stats, self.engine.runner.graphs
        return WorkerInfo(
            model_id=e.model_id, max_model_len=e.max_model_len, num_kv_blocks=e.kv.num_blocks,
            kv_block_size=e.kv.block_size, num_free_kv_blocks=e.kv.num_free_blocks,
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting) + self._pending,
            dtype=str(e.dtype).removeprefix("torch."), role=self.role, compat=self.compat,
            speculative=_drafter(e.config.speculative), spec_verify_rounds=spec.verify_rounds,
            spec_draft_tokens=spec.draft_tokens, spec_accepted_tokens=spec.accepted_tokens,
            spec_emitted_tokens=spec.emitted_tokens, prefix_cache_queries=e.kv.stats.queries,
            prefix_cache_hits=e.kv.stats.hits, stage_compute_s=e.runner.compute_s,
            replay_checks=graphs.checked_steps if graphs else 0, replay_mismatches=graphs.mismatches if graphs else 0)

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Tokenize here, then hand the request to the engine thread, which validates it
        (Engine.add_request); a rejection comes back as the stream's first item."""
        if not self.alive:
            raise Unavailable(f"engine loop is not running: {self.error}")
        prompt = self.processor.prompt_ids(request)
        arrival = time.monotonic()   # queue time from here, the inbox included (vLLM's: after its tokenizer too)
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequest(f"request id {rid} is already running", "request_id")
        if request.sampling.structured is not None:
            await self._compile(request.sampling.structured)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._pending += 1
        self._send(("add", rid, prompt, request.sampling, request.resume,
                    "messages" if request.messages else "prompt", arrival))
        finished = False
        try:
            first = True
            while not finished:
                outs, error = await _take_ready(q)
                finished = error is not None or outs[-1].finished
                if outs:
                    yield self._chunk(_merge(outs), prompt if first else None)
                    first = False
                if error is not None:
                    raise error
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send(("abort", rid))

    async def _compile(self, spec: StructuredOutput) -> None:
        """Compile a structured output's grammar into the engine's cache in a thread, within
        its time limit: neither the engine loop nor this event loop waits on a slow schema (the
        engine thread then finds it cached). The tokenizer's index, built once, is not timed."""
        grammars = self.engine.grammars
        await asyncio.to_thread(lambda: grammars.ll_tokenizer)
        limit = grammars.limits.compile_timeout_s
        try:
            await asyncio.wait_for(asyncio.to_thread(grammars.compile, spec), limit)
        except asyncio.TimeoutError:
            raise InvalidRequest(f"the structured output took more than {limit:g} s to compile", spec.param) from None
        except ConfigError as e:
            raise InvalidRequest(str(e), e.param) from None

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver_step(self, items: list[tuple[str, object]]) -> None:
        """A step's outputs with one wake-up of each event loop, not one per request (each
        call_soon_threadsafe writes to the loop's wake-up socket and takes the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _run(self, engine: Engine | Callable[[], Engine], built: queue.SimpleQueue) -> None:
        try:
            self.engine = engine if isinstance(engine, Engine) else engine()
        except BaseException as e:
            built.put(e)
            return
        built.put(self.engine)
        try:
            while not self._stop:
                idle = not self.engine.has_unfinished
                self._drain_inbox()
                if not self.engine.has_unfinished:
                    self.last_step = time.monotonic()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if idle and not self._gather_arrivals():
                    continue          # stopping, or every request was aborted while it waited
                try:
                    outputs = self.engine.step()
                except Exception as e:  # one bad step fails its requests, not the worker
                    log.exception("engine step failed")
                    for rid in self.engine.fail_running():
                        self._deliver(rid, step_error(e))
                    continue
                self._deliver_step([(out.request_id, out if out.error is None else
                                     InternalError(f"the engine failed this request: {out.error}"))
                                    for out in outputs])
                self.last_step = time.monotonic()
        except BaseException as e:  # the loop is dead: fail every open stream, never hang them
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, Unavailable(f"engine loop failed: {e!r}"))
            raise

    def _gather_arrivals(self) -> bool:
        """Work arrived at an idle engine: wait up to max_queue_delay_ms for more requests to
        join its first step, or until a full batch is waiting (max_num_seqs, or max_waiting if
        fewer may queue). Without it, a batch sent at once is prefilled in pieces: the first
        request to arrive runs alone and the rest wait for it (a pipeline then fills and drains
        twice). False: do not step (the loop is stopping, or every request was aborted: the
        next one starts a wait of its own)."""
        limits = self.engine.config.scheduler
        full = min(limits.max_num_seqs, limits.max_waiting)
        deadline = time.monotonic() + limits.max_queue_delay_ms / 1000
        while len(self.engine.scheduler.waiting) < full:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop or not self.engine.has_unfinished:
                break
            self._wake.wait(timeout=remaining)
            self._wake.clear()
            self._drain_inbox()
        return not self._stop and self.engine.has_unfinished

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, sampling, resume, prompt_param, arrival = command
                self._pending -= 1
                if rid not in self._streams:
                    continue  # the client went away before the engine saw it
                try:
                    self.engine.add_request(prompt, sampling, rid, resume, arrival)
                except Exception as e:
                    self._deliver(rid, admission_error(e, prompt_param))
            else:
                self.engine.abort(command[1])

    def _chunk(self, out: RequestOutput, prompt: list[int] | None) -> GenerateChunk:
        lps = tuple(
            TokenLogprobInfo(lp.token_id, self.processor.token_text(lp.token_id), lp.logprob,
                             self.processor.token_bytes(lp.token_id),
                             tuple(TopToken(t, self.processor.token_text(t), v, self.processor.token_bytes(t))
                                   for t, v in lp.top))
            for lp in out.logprobs)
        return GenerateChunk(text=out.new_text, token_ids=tuple(out.new_token_ids), logprobs=lps,
                             finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                             completion_tokens=out.completion_tokens,
                             prompt_token_ids=tuple(prompt or ()), accepted_tokens=out.accepted_tokens,
                             rejected_tokens=out.rejected_tokens, cached_tokens=out.cached_tokens,
                             timings=out.timings)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)


async def _take_ready(q: asyncio.Queue) -> tuple[list[RequestOutput], BaseException | None]:
    """The next output, and every output of the same request already queued behind it: when
    the consumer (the gRPC stream, the client) falls behind the engine under load, the
    outputs of several steps go out as one message instead of queueing one per step."""
    outs: list[RequestOutput] = []
    item = await q.get()
    while True:
        if isinstance(item, BaseException):
            return outs, item
        outs.append(item)
        if item.finished or q.empty():
            return outs, None
        item = q.get_nowait()


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the new tokens, text and logprobs of all,
    the counters and finish state of the last."""
    if len(outs) == 1:
        return outs[0]
    return replace(outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outs), logprobs=[lp for o in outs for lp in o.logprobs])


def _drafter(spec) -> str:
    """Who drafts, for Info: "" (no speculation), "self:2" (in process), "self:2 @ host:port"."""
    if spec.draft is None:
        return ""
    return f"{spec.draft} @ {spec.draft_address}" if spec.draft_address else spec.draft


def admission_error(e: Exception, prompt_param: str) -> WorkerError:
    """What Engine.add_request raised, as the error the client sees."""
    if isinstance(e, ContextLengthError):
        return ContextLengthExceeded(str(e), prompt_param)
    if isinstance(e, ConfigError):
        param = prompt_param if e.param == "prompt" else e.param
        return InvalidRequest(str(e), param)
    if isinstance(e, QueueFull):
        return Saturated(str(e))
    log.exception("admitting a request failed")
    return InternalError(f"the worker could not admit the request: {type(e).__name__}")


def step_error(e: Exception) -> WorkerError:
    """A failed step's error for its requests: a lost peer (an AFD expert node) is a failure
    another replica can take over (Unavailable); anything else is this engine's fault
    (InternalError, 500), and the gateway must not replay the request elsewhere, since the
    same request could fail the next replica's batch too."""
    if isinstance(e, (ConnectionError, TimeoutError, TransportError)):
        return Unavailable(f"engine step failed: {e}")
    return InternalError(f"engine step failed: {type(e).__name__}: {e}")
