"""The batch-invariant mode (--batch-invariant, tessera/batch_invariant.py): in bfloat16 as in
float32, a request's logprobs are bitwise the same alone and among 63 other requests; a seeded
stream resumed on another engine (its prompt and output so far prefilled again, in chunks, as a
failover does) continues with the same tokens and the same logprobs bits; speculative greedy
output (prompt lookup, the target's own first layers) is plain greedy output; through
`tessera up`, a seeded stream whose worker is SIGKILLed ends as the undisturbed one. Models
and builds the mode cannot hold to it are refused at start-up."""
from __future__ import annotations

import asyncio
import os
import secrets
import signal

import httpx
import pytest
import torch
import yaml

from otlp_receiver import Receiver, attrs
from servers import Logged, free_port, free_port_range, wait_until

DTYPES = ("float32", "bfloat16")
PROMPT = "Explain in two sentences why the sky is blue and why sunsets are red."


@pytest.fixture(scope="module", params=DTYPES)
def invariant(request):
    """The default model in the mode (its own copy: the mode changes the model's layers), and a
    function making engines on it."""
    from tessera.config import EngineConfig
    from tessera.engine import Engine
    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    dtype = getattr(torch, request.param)
    model, _ = load_model("smollm2", dtype)
    tokenizer = load_tokenizer("smollm2")

    def engine(**options) -> Engine:
        return Engine(EngineConfig(model="smollm2", dtype=request.param, batch_invariant=True, **options),
                      model=model, tokenizer=tokenizer)
    return engine, tokenizer


def _run(engine, prompts, sampling) -> list[tuple[list[int], list[float]]]:
    """Every prompt to the end: (token ids, their logprobs), in prompt order."""
    ids = [engine.add_request(p, sampling) for p in prompts]
    out = {i: ([], []) for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    return [out[i] for i in ids]


def test_a_request_alone_equals_it_among_63_others(invariant):
    from tessera.config import SamplingParams
    engine_for, tokenizer = invariant
    prompt = tokenizer.encode(PROMPT)
    g = torch.Generator().manual_seed(3)
    others = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
              for n in torch.randint(4, 48, (63,), generator=g)]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    alone = _run(engine_for(), [prompt], sampling)[0]
    # the request is the 40th: prompt rows of its step are surrounded by other prompts' rows,
    # and its decode rows by up to 63 others
    crowd = _run(engine_for(), others[:39] + [prompt] + others[39:], sampling)[39]
    assert len(alone[0]) == 12 and alone == crowd


def test_a_resumed_seeded_stream_continues_bitwise(invariant):
    """What a failover does: the prompt and the 9 tokens already sent are prefilled again on
    another engine (here in chunks of 16 tokens), and sampling goes on from the same seed."""
    from tessera.config import SamplingParams, SchedulerConfig
    from tessera.request import Resume
    engine_for, tokenizer = invariant
    prompt = tokenizer.encode(PROMPT)
    sampling = SamplingParams(max_tokens=20, temperature=0.8, seed=1234, logprobs=0, ignore_eos=True)
    tokens, logprobs = _run(engine_for(), [prompt], sampling)[0]
    engine = engine_for(scheduler=SchedulerConfig(max_num_batched_tokens=16))
    rid = engine.add_request(prompt, sampling, resume=Resume(output_token_ids=tuple(tokens[:9])))
    rest, rest_logprobs = [], []
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id == rid:
                rest.extend(o.new_token_ids)
                rest_logprobs.extend(lp.logprob for lp in o.logprobs)
    assert (rest, rest_logprobs) == (tokens[9:], logprobs[9:])


@pytest.mark.parametrize("draft", ["ngram", "self:8"])
def test_speculative_greedy_is_plain_greedy(invariant, draft):
    from tessera.config import SamplingParams, SpeculativeConfig
    engine_for, tokenizer = invariant
    prompts = [tokenizer.encode(p) for p in (
        PROMPT, "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef fib_table(n):\n")]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = engine_for().generate(prompts, sampling)
    spec = engine_for(speculative=SpeculativeConfig(draft=draft))
    ids = [spec.add_request(p, sampling) for p in prompts]
    out, accepted = {i: [] for i in ids}, 0
    while spec.has_unfinished:
        for o in spec.step():
            out[o.request_id].extend(o.new_token_ids)
            accepted = max(accepted, o.accepted_tokens)
    assert [out[i] for i in ids] == plain
    assert accepted > 0, "no draft token was accepted: nothing was verified"


def test_what_the_mode_cannot_hold_is_refused(tiny_models):
    from tessera import batch_invariant
    from tessera.config import ConfigError, EngineConfig
    from tessera.models.loader import load_model
    from tessera.vllm_backend.engine import _check_supported
    moe, _ = load_model(tiny_models["mixtral"], torch.float32)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        batch_invariant.apply(moe, torch.float32, None)
    dense, _ = load_model(tiny_models["llama"], torch.float32)
    with pytest.raises(ConfigError, match="quantized"):
        batch_invariant.apply(dense, torch.float32, "int4")
    with pytest.raises(ConfigError, match="--batch-invariant"):
        _check_supported(EngineConfig(model="smollm2", batch_invariant=True))


def test_the_kernel_path_is_in_the_compatibility_hash():
    """Replicas fail over to each other only where their hashes match: the mode's hash differs
    from the default's, and names the CPU kind and build its bits come from."""
    from tessera import batch_invariant
    from tessera.config import EngineConfig
    from tessera.cpu_kind import describe_cpu
    from tessera.engine import Engine
    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    model, _ = load_model("smollm2", torch.float32)
    tokenizer = load_tokenizer("smollm2")
    default = Engine(EngineConfig(model="smollm2", dtype="float32", enforce_eager=True), model=model,
                     tokenizer=tokenizer)
    mode = Engine(EngineConfig(model="smollm2", dtype="float32", enforce_eager=True, batch_invariant=True),
                  model=model, tokenizer=tokenizer)
    assert default.compat_hash != mode.compat_hash
    assert batch_invariant.kernel_path(torch.float32).startswith(describe_cpu()["kind"] + "/")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_without_tiles_gives_a_prompt_row_its_decode_bits(dtype):
    """40 rows of one prompt chunk, which the kernel would attend in tiles, with tiles=False:
    each row's output is bitwise that of the same row sent alone, as a decode row."""
    from tessera_kernels import paged_attention_cpu as pa
    if not pa.available():
        pytest.skip("no C compiler: the kernel is not built")
    g = torch.Generator().manual_seed(0)
    KV, H, D, bs, n = 3, 9, 64, 16, 40
    k_cache = torch.randn(KV, 8 * bs, D, generator=g).to(dtype)
    v_cache = torch.randn(KV, 8 * bs, D, generator=g).to(dtype)
    tables = torch.tensor([[5, 2, 7]] * n)
    lens = torch.arange(1, n + 1)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    assert pa.tiles_planned(tables, lens, bs, D, dtype) > 0      # the default call would tile these rows
    rows = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, D ** -0.5, tiles=False)
    for i in range(n):
        alone = pa.paged_decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], bs, D ** -0.5)
        assert torch.equal(rows[i:i + 1], alone), i


def _seeded_chat(client, model: str, i: int, first: asyncio.Event | None = None, traceparent: str | None = None):
    async def run():
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell a story about the number {i}."}],
            stream=True, max_tokens=64, temperature=0.9, seed=100 + i, extra_body={"ignore_eos": True},
            extra_headers={"traceparent": traceparent} if traceparent else None)
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if first is not None and text:
                    first.set()
        return text
    return run()


@pytest.mark.e2e
def test_up_a_seeded_stream_failed_over_in_bf16_ends_as_the_undisturbed_one(tmp_path):
    """`tessera up` with two bf16 workers in the mode: four seeded streams, worker-0 SIGKILLed
    while they run; every stream's text equals what the same requests give undisturbed. With
    tracing on, a stream that failed over is one trace holding both workers: an attempt (route
    span) to each, the first failed, the failover event, and the second worker's own spans
    (the killed worker's spans die with it: SIGKILL ends no span)."""
    from openai import AsyncOpenAI
    receiver = Receiver()
    spec = yaml.safe_load(open("deploy/topologies/single.yaml"))
    spec["dtype"] = "bfloat16"
    worker_port = free_port_range(2)
    spec["roles"]["worker"].update(port=worker_port, batch_invariant=True)
    topology = tmp_path / "invariant.yaml"
    topology.write_text(yaml.safe_dump(spec))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    up = Logged("up", str(topology), "--port", str(port), "--restart-backoff-s", "0.2",
                "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}", env=env)
    traces = [secrets.token_hex(16) for _ in range(4)]
    try:
        url = f"http://127.0.0.1:{port}"
        for i in range(2):
            up.wait_for(rf"tessera worker ready on 127.0.0.1:{worker_port + i}", 240)
        wait_until(lambda: httpx.get(url + "/health/ready", timeout=5).status_code == 200, 120,
                   "the gateway never became ready")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        async def run():
            client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=180)
            before = await asyncio.gather(*(_seeded_chat(client, model, i) for i in range(4)))
            firsts = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(_seeded_chat(client, model, i, firsts[i],
                                                      f"00-{traces[i]}-{secrets.token_hex(8)}-01"))
                     for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            os.kill(up.pid("worker-0"), signal.SIGKILL)
            return before, await asyncio.gather(*tasks)
        before, after = asyncio.run(run())
        failovers = [line for line in httpx.get(url + "/metrics").text.splitlines()
                     if line.startswith("tessera_gateway_failovers_total")]
        assert failovers and float(failovers[0].split()[-1]) >= 1, failovers
        assert after == before and all(before)
        def failed_over():
            return [t for t in traces if any(e.name == "failover" for _, s in receiver.trace(t) for e in s.events)]
        wait_until(failed_over, 20, "no traced stream shows the failover")
        for t in failed_over():
            spans = receiver.wait_for(t, {"worker.generate", "decode"})
            (root,) = [s for _, s in spans if s.name == "POST /v1/chat/completions"]
            routes = sorted((s for _, s in spans if s.name == "route"), key=lambda s: s.start_time_unix_nano)
            assert [attrs(s)["tessera.worker.address"].rsplit(":", 1)[1] for s in routes] == \
                [str(worker_port), str(worker_port + 1)]
            assert all(s.parent_span_id == root.span_id for s in routes) and routes[0].status.code == 2
            workers = [(r, s) for r, s in spans if s.name == "worker.generate"]
            assert [(r["tessera.replica"], s.parent_span_id) for r, s in workers] == [(1, routes[1].span_id)]
    finally:
        up.close()
        receiver.server.stop(0)
