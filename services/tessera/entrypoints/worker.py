"""The worker process: load the engine, serve tessera.rpc.v1.Worker and grpc.health.v1.
An attention node is this same process with an AFD engine (cli.py: attention-node)."""
from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import random
import signal
import time
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tessera import logs, mtls, tracing
from tessera.async_engine import AsyncEngine
from tessera.chat_config import ChatConfig, template_name, template_text
from tessera.config import ConfigError, EngineConfig
from tessera.cpu_pinning import pin_engine_threads
from tessera.engine import Engine
from tessera.gc_heap import freeze_startup_heap
from tessera.generation_defaults import GenerationConfigSource, GenerationDefaults, read
from tessera.rpc import convert, options
from tessera.rpc.v1 import worker_pb2, worker_pb2_grpc
from tessera.worker_api import InternalError, InvalidRequest, Unavailable, WorkerError

log = logging.getLogger("tessera.worker")
SERVICE = "tessera.rpc.v1.Worker"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, generation_defaults: GenerationDefaults = GenerationDefaults(),
                 chat: ChatConfig = ChatConfig()) -> None:
        self.engine = engine
        self.generation_defaults = generation_defaults
        self.chat = chat
        self.draining = False
        self._outboxes: set[_Outbox] = set()

    def drain(self) -> None:
        """Sessions take no new request and end when their running ones have (a session
        otherwise stays open as long as its gateway, and would hold the drain its whole grace)."""
        self.draining = True
        for outbox in self._outboxes:
            outbox.wake()

    async def Generate(self, request, context):
        metadata = dict(context.invocation_metadata() or ())
        try:
            carrier = {k: metadata[k] for k in ("traceparent", "tracestate") if k in metadata}
            async for chunk in self._outputs(request, metadata.get("x-request-id"), carrier):
                yield convert.chunk_to_proto(chunk)
        except WorkerError as e:
            await context.abort(*convert.error_to_status(e))

    async def Session(self, request_iterator, context):
        """Generations multiplexed over one stream (worker.proto): a task per request puts its
        outputs into one outbox, and each message sent holds all the outbox gathered. The engine
        thread wakes this loop once per step with every request's output, so under load a
        message carries one step of the whole session."""
        outbox, running = _Outbox(), {}

        async def generate(msg, log_id: str, carrier: dict) -> None:
            try:
                async for chunk in self._outputs(msg, log_id, carrier):
                    outbox.put(convert.update_to_proto(msg.request_id, chunk))
            except WorkerError as e:
                outbox.put(convert.update_to_proto(msg.request_id, error=e))
            except Exception as e:   # a bug: this request ends with a 500 now, not after an idle timeout
                log.exception("request %s failed in its session", msg.request_id)
                outbox.put(convert.update_to_proto(msg.request_id, error=InternalError(
                    f"the worker failed this request: {type(e).__name__}")))

        def finished(rid: str, task: asyncio.Task) -> None:
            """Also when the task was cancelled before it ever ran (its finally would not)."""
            if running.get(rid) is task:
                del running[rid]
            outbox.wake()

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    if msg.WhichOneof("kind") == "generate":
                        rid = msg.generate.request_id
                        if self.draining:
                            outbox.put(convert.update_to_proto(rid, error=Unavailable("the worker is draining")))
                        elif rid in running:
                            outbox.put(convert.update_to_proto(rid, error=InvalidRequest(
                                f"request id {rid} is already running", "request_id")))
                        else:
                            running[rid] = task = asyncio.create_task(generate(msg.generate, msg.log_request_id,
                                                                                dict(msg.trace_context)))
                            task.add_done_callback(functools.partial(finished, rid))
                    elif msg.abort in running:
                        running[msg.abort].cancel()
            finally:
                outbox.wake()

        reader = asyncio.create_task(read())
        self._outboxes.add(outbox)
        try:
            while not ((reader.done() or self.draining) and not running and not outbox.items):
                for message in _messages(await outbox.take()):
                    yield message
        finally:
            self._outboxes.discard(outbox)
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _outputs(self, request, log_id: str | None, carrier: dict):
        """One generation's chunks; its failure as a WorkerError. carrier: the gateway's trace
        context (tracing.py), whose child this request's span is."""
        logs.request_id.set(log_id or request.request_id)
        span = tracing.server_span("worker.generate", carrier, **{"tessera.request_id": request.request_id})
        t0, tokens, finish, prompt, chunk, error = time.monotonic(), 0, None, None, None, None
        try:
            req = convert.generate_request_from_proto(request)
            logs.event(log, "generate", prompt="messages" if req.messages is not None else
                       "token_ids" if req.token_ids is not None else "text", max_tokens=req.sampling.max_tokens)
            async for chunk in self.engine.generate(req):
                prompt = chunk.prompt_tokens if prompt is None else prompt   # counted once tokenized
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
                yield chunk
        except ConfigError as e:
            error = InvalidRequest(str(e))
            raise error from None
        except WorkerError as e:
            error = e
            logs.event(log, "generate failed", error=str(e))
            raise
        finally:
            logs.event(log, "generate done", prompt_tokens=prompt, completion_tokens=tokens, finish_reason=finish,
                       duration_ms=round((time.monotonic() - t0) * 1000, 1))
            tracing.end_generation(span, chunk, prompt, tokens, finish, error)

    async def Abort(self, request, context):
        self.engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)

    async def Tokenize(self, request, context):
        """In a thread: a long text or template must not hold up the streams this loop serves."""
        try:
            req = convert.tokenize_request_from_proto(request)
            out = await asyncio.to_thread(self.engine.processor.tokenize, req, self.engine.info().max_model_len)
            return convert.tokenized_to_proto(out)
        except WorkerError as e:
            await context.abort(*convert.error_to_status(e))

    async def Detokenize(self, request, context):
        try:
            text = await asyncio.to_thread(self.engine.processor.detokenize, tuple(request.token_ids))
            return worker_pb2.DetokenizeResponse(text=text)
        except WorkerError as e:
            await context.abort(*convert.error_to_status(e))

    async def Info(self, request, context):
        return convert.info_to_proto(replace(
            self.engine.info(), generation_defaults=self.generation_defaults,
            tool_call_parser=self.chat.tool_call_parser or "", chat_template=template_name(self.chat.chat_template)))


MESSAGE_BYTES = 4 << 20   # a session message stays far below the client's 64 MiB receive limit


def _messages(updates: list) -> list:
    """Updates as SessionResponses of at most MESSAGE_BYTES each (one update may be alone
    above it): a backlog of many steps, a slow reader or large logprobs never make one message
    the client refuses, which would fail every request of the session."""
    messages, batch, size = [], [], 0
    for u in updates:
        n = u.ByteSize()
        if batch and size + n > MESSAGE_BYTES:
            messages.append(worker_pb2.SessionResponse(updates=batch))
            batch, size = [], 0
        batch.append(u)
        size += n
    if batch:
        messages.append(worker_pb2.SessionResponse(updates=batch))
    return messages


class _Outbox:
    """What a session has to send, and a wake-up for its writer."""

    def __init__(self) -> None:
        self.items: list = []
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        self.items.append(item)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    async def take(self) -> list:
        await self._ready.wait()
        self._ready.clear()
        items, self.items = self.items, []
        return items


async def _watch_health(engine: AsyncEngine, health_servicer: health.HealthServicer) -> None:
    """NOT_SERVING once the engine loop thread has died."""
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if engine.alive else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            health_servicer.set(name, status)
        await asyncio.sleep(1.0)


async def serve(config: EngineConfig, host: str, port: int, build=None, role: str = "worker",
                registration=None, metrics_port: int | None = None, shutdown_grace_s: float = 30.0,
                engine=None, generation: GenerationConfigSource = GenerationConfigSource(),
                chat: ChatConfig = ChatConfig()) -> None:
    """build() makes the engine (default: a monolithic one); an attention node passes its own;
    `engine` is one already running with AsyncEngine's face (the vLLM adapter, vllm_backend/).
    registration = (redis url, key prefix, advertised address) registers it with heartbeats;
    metrics_port serves the worker's Prometheus metrics over HTTP; `generation` names the
    sampling defaults its Info reply carries (a bad file stops the start, before the model
    loads); `chat` its chat template and tool-call parser (chat_config.py). Serves until SIGTERM
    or SIGINT, then drains (see _drain)."""
    defaults = read(generation, config.model)
    one_malloc_arena()   # before the engine thread exists
    build = _templated(build or (lambda: _warmed(_pinned(Engine(config)))), chat.chat_template)
    engine = engine or AsyncEngine(build, role=role)
    if metrics_port:
        from tessera.metrics import serve_worker_metrics
        serve_worker_metrics(engine, role, metrics_port, host)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), *options.ACCEPT_KEEPALIVE,
                                      *mtls.SERVER_OPTIONS], interceptors=[mtls.AioServerInterceptor()])
    servicer = WorkerServicer(engine, defaults, chat)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = mtls.add_port(server, host, port)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await server.start()
    tasks = [asyncio.create_task(_watch_health(engine, health_servicer))]
    if registration:
        tasks.append(asyncio.create_task(_register(engine, config, role, registration)))
    freeze_startup_heap()   # the engine is built and warmed: its objects stay
    log.info("worker %s serving on %s:%d", engine.info().model_id, host, bound)
    print(f"tessera worker ready on {host}:{bound}", flush=True)
    try:
        await stopping.wait()
        await _drain(server, servicer, health_servicer, tasks, shutdown_grace_s)
    finally:
        for task in tasks:
            task.cancel()
        engine.shutdown()


def _templated(build, spec: str | None):
    """build, then the --chat-template in place of the tokenizer's, set before AsyncEngine reads the
    compatibility hash (which covers the template: a stream fails over only to a worker rendering alike)."""
    if spec is None:
        return build
    text = template_text(spec)

    def built() -> Engine:
        engine = build()
        engine.tokenizer.chat_template = text
        return engine
    return built


def one_malloc_arena() -> None:
    """glibc gives a thread that allocates an arena of its own, and gives a thread arena's
    free top back to the kernel at once: the engine thread's per-step tensors (logits,
    activations) then come back as fresh pages every step, one page fault per 4 KiB (with
    one arena, a served decode at a large batch takes about a tenth of the faults).
    One arena for the process, as MALLOC_ARENA_MAX=1 sets; without glibc, nothing changes."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)    # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _pinned(engine: Engine) -> Engine:
    """The engine's threads pinned (cpu_pinning.py), from the engine thread that built it and
    runs its parallel regions, before the warm-up."""
    pin_engine_threads(engine.config)
    return engine


def _record_step_graphs(engine: Engine, budget_s: float) -> None:
    """For each graph size R (step_graph.StepGraphs.row_counts), a prompt of R tokens alone in
    its step (the recording) and then one of the fewest tokens that pad to R (the check, made on
    padding rows), until budget_s has passed: a user's first prompts are then replayed, not
    recorded and checked, so the first requests after a start get the TTFT of later ones.
    Recording every size takes seconds in bf16 and several times longer in float32 on one
    thread: hence the budget. Sizes the graphs refuse are skipped."""
    from tessera.config import SamplingParams
    graphs = engine.runner.graphs
    if graphs is None or budget_s <= 0:
        return
    t0 = time.monotonic()
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    fits = min(engine.max_model_len - 1, engine.kv.num_blocks * engine.kv.block_size // 2)
    sizes = [rows for rows in graphs.row_counts() if rows <= fits]
    for rows, tokens in ((rows, tokens) for rows in sizes for tokens in (rows, graphs.shortest(rows))):
        if time.monotonic() - t0 > budget_s:
            break
        if graphs.may_replay(rows):
            # random tokens: no prefix-cache hit shortens the step
            engine.generate([[rng.randrange(vocab) for _ in range(tokens)]], SamplingParams(temperature=0, max_tokens=1))
    checked = sum(graphs.graphs[rows].verified for rows in sizes if rows in graphs.graphs)
    log.info("step graphs: %d of %d sizes recorded and checked in %.1f s (--graph-warmup-s %g)",
             checked, len(sizes), time.monotonic() - t0, budget_s)


def _warmed(engine: Engine) -> Engine:
    """Requests through prefill and decode before the worker says it is ready: the CPU
    kernels are compiled and oneDNN's GEMM primitives built now, not in a user's request.
    Short ones fill no KV block; nothing of the long one stays in the prefix cache."""
    from tessera.config import SamplingParams
    from tessera.kv_cache import PrefixCacheStats
    t0 = time.monotonic()
    bos = engine.model_config.bos_token_id or 1
    half = max(1, engine.kv.block_size // 2 - 2)
    # 8 of them: a decode step of 8 rows also packs the weights of the packed-weight linears
    # (tessera_kernels.amx_linear where the CPU has AMX, tile_linear where it has AVX512-BF16).
    limits = engine.config.scheduler
    rows = min(8, limits.max_num_seqs, limits.max_waiting, engine.kv.num_blocks)
    engine.generate([[bos] * half] * rows, SamplingParams(temperature=0, max_tokens=2))
    # Then one step as long as the token budget (as vLLM's profile run): oneDNN makes its
    # large-matrix kernels now, not in the first busy minute (which would otherwise run a
    # few percent slower than the next). Its blocks leave the prefix cache, and
    # the warm-up's tokens the hit-rate counters.
    full = min(engine.config.scheduler.max_num_batched_tokens, engine.kv.num_blocks * engine.kv.block_size // 2,
               engine.max_model_len - 2)
    if full > half:
        engine.generate([[bos] * full], SamplingParams(temperature=0, max_tokens=2))
    _record_step_graphs(engine, engine.config.graph_warmup_s)
    engine.reset_prefix_cache()
    engine.kv.stats = PrefixCacheStats()
    log.info("warm-up done in %.1f s", time.monotonic() - t0)
    return engine


async def _drain(server: grpc.aio.Server, servicer: WorkerServicer, health_servicer: health.HealthServicer, tasks,
                 grace_s: float) -> None:
    """Leave the registry at once (the gateway stops routing here), say NOT_SERVING, refuse new
    requests, and give the ones in flight up to grace_s to finish."""
    log.info("draining: deregistering, finishing in-flight requests (up to %.0f s)", grace_s)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)   # _register's finally removes the record
    health_servicer.enter_graceful_shutdown()
    servicer.drain()
    await server.stop(grace_s)


async def _register(engine: AsyncEngine, config: EngineConfig, role: str, registration) -> None:
    """Heartbeat this worker's record (with its current load) into the registry until cancelled."""
    import uuid

    from tessera.registry import RedisRegistry, WorkerRecord, stay_registered
    url, prefix, address = registration
    registry = RedisRegistry(url, prefix=prefix)
    worker_id = f"{role}-{address}-{uuid.uuid4().hex[:6]}"
    version = engine.compat    # model, resolved dtype, tokenizer, engine version

    def record() -> WorkerRecord:
        info = engine.info()
        return WorkerRecord(worker_id, role, info.model_id, address, config.scheduler.max_num_seqs,
                            info.num_running + info.num_waiting, version)
    await stay_registered(registry, worker_id, record)


def main(config: EngineConfig, host: str, port: int, registration=None, metrics_port: int | None = None,
         shutdown_grace_s: float = 30.0, generation: GenerationConfigSource = GenerationConfigSource(),
         chat: ChatConfig = ChatConfig()) -> int:
    """`tessera worker`."""
    asyncio.run(serve(config, host, port, registration=registration, metrics_port=metrics_port,
                      shutdown_grace_s=shutdown_grace_s, generation=generation, chat=chat))
    return 0
