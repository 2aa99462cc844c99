"""The int8 KV cache (--kv-cache-dtype int8, tessera_kernels.kv_int8): its writes and its C
attention kernel against the torch reference, and the default model's logits, held-out
perplexity and a served chat with it, against the 16-bit cache."""
from __future__ import annotations

import math

import pytest
import torch

from tessera_kernels import cbuild, kv_int8, paged_attention_cpu

pytestmark = pytest.mark.skipif(not kv_int8.available(), reason="no C compiler: the int8 kernel is not built")


def _filled_caches(KV: int, D: int, slots: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(slots, KV, D, generator=g) * 2).to(dtype)
    v = torch.randn(slots, KV, D, generator=g).to(dtype)
    k_cache = torch.zeros(KV, slots, kv_int8.row_bytes(D), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    kv_int8.kv_write(k, v, k_cache, v_cache, torch.randperm(slots, generator=g))
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_reference_bytes_and_bounds_the_error(dtype):
    T, KV, D, S = 37, 3, 64, 64
    k, v = (torch.randn(T, KV, D) * 3).to(dtype), torch.randn(T, KV, D).to(dtype)
    k[5, 1] = 0   # an all-zero row: scale 0
    slots = torch.randperm(S)[:T]
    slots[7] = paged_attention_cpu.PAD_SLOT
    caches = [torch.full((KV, S, D + 4), 3, dtype=torch.int8) for _ in range(4)]
    kv_int8.kv_write(k, v, caches[0], caches[1], slots)
    kv_int8.kv_write_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    keep = slots != paged_attention_cpu.PAD_SLOT
    back = kv_int8.dequantize(caches[0][:, slots[keep]], torch.float32).transpose(0, 1)
    exact = k[keep].float()
    # rounding to the nearest step: at most half a step, max|x| / 254, per row
    assert ((back - exact).abs() <= exact.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-4)).all()   # float32 rounding of x * 127 / max and of q * scale
    assert (caches[0][:, 0:S][:, ~torch.isin(torch.arange(S), slots[keep])] == 3).all()   # nothing else written
    with pytest.raises(IndexError):
        kv_int8.kv_write(k, v, caches[0], caches[1], torch.full((T,), S))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 64)])
def test_int8_kernel_matches_reference(dtype, H, KV, D):
    bs, blocks = 16, 48
    k_cache, v_cache = _filled_caches(KV, D, blocks * bs, dtype)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 15, 16, 17, 100, 257, 300])
    tables = torch.stack([torch.randperm(blocks, generator=g)[:20] for _ in lens])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    for window, softcap in ((0, 0.0), (40, 0.0), (0, 20.0)):
        out = kv_int8.paged_decode_attention_int8(q, k_cache, v_cache, tables, lens, bs, D ** -0.5, window, softcap)
        ref = kv_int8.paged_decode_attention_int8_ref(q.float(), k_cache, v_cache, tables, lens, bs, D ** -0.5,
                                                      window, softcap)
        # float32: only the order of the sums differs; bf16: the result's own rounding (half
        # an ulp, 2^-9 relative) on top
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * ref.abs() + 1e-5
        assert ((out.float() - ref).abs() <= tol).all(), (window, softcap)


def test_int8_kernel_takes_one_slot_blocks_and_strided_queries():
    """A draft tree's rows (block size 1, a table of slots) and q as a view of a wider tensor."""
    H, KV, D = 9, 3, 64
    k_cache, v_cache = _filled_caches(KV, D, 256, torch.float32)
    g = torch.Generator().manual_seed(2)
    slots = torch.stack([torch.randperm(256, generator=g)[:50] for _ in range(3)])
    lens = torch.tensor([50, 3, 27])
    q = torch.randn(3, H + 3, D, generator=g)[:, :H]
    out = kv_int8.paged_decode_attention_int8(q, k_cache, v_cache, slots, lens, 1, 0.125)
    ref = kv_int8.paged_decode_attention_int8_ref(q, k_cache, v_cache, slots, lens, 1, 0.125)
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.skipif("avx512f" not in cbuild.cpu_flags(),
                    reason="this CPU has no AVX-512: its own build is the AVX2 one, which the tests above ran")
def test_the_avx2_build_of_the_int8_kernels(tmp_path):
    """The kernel and write tests again with the C built for AVX2 (TESSERA_MARCH=haswell, its
    own cache), as test_attention_window.py does for the 16-bit kernel."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TESSERA_MARCH": "haswell", "TESSERA_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "reference or one_slot or every_attention_path or replay"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert list((tmp_path / "kernels").glob("paged_decode_attention_int8-*.so"))


def _int8_step(dtype, seed=0):
    """test_attention_window's mixed step (decode rows, fresh prompts, a later chunk, a draft
    tree) over an int8 cache, and the same step over that cache dequantized, its new K/V
    rounded through int8 as the write will: every path of both then reads the same values."""
    from test_attention_window import _mixed_step
    step = _mixed_step(dtype)
    k8, v8 = kv_int8.quantize_ref(step.k_cache), kv_int8.quantize_ref(step.v_cache)
    step.k_cache, step.v_cache = kv_int8.dequantize(k8, dtype), kv_int8.dequantize(v8, dtype)
    step.k = [kv_int8.dequantize(kv_int8.quantize_ref(k), dtype) for k in step.k]
    step.v = [kv_int8.dequantize(kv_int8.quantize_ref(v), dtype) for v in step.v]
    return step, k8, v8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["kernel", "torch", "masks"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (10, 5.0)])
def test_every_attention_path_reads_the_int8_cache(dtype, path, window, softcap, monkeypatch):
    """paged_attention over the int8 cache against the same step over its dequantized values:
    the int8 kernel, the torch paths (decode gathered, SDPA over a chunk's context; the kernel
    off) and explicit masks (tree verification's), with a window and soft-capping."""
    from tessera.batch import build_forward_batch
    from tessera.layers import attention
    from tessera.scheduler import StepPlan
    from test_attention_window import BS, SCALE
    if path == "torch":
        monkeypatch.setattr(attention, "_int8_kernel_applies", lambda q, cache: False)
        monkeypatch.setattr(attention, "_kernel_applies", lambda q: False)
    step, k8, v8 = _int8_step(dtype)
    batch = build_forward_batch(StepPlan(tuple(step.entries)), BS)
    masks = [c.mask for c in batch.prefills] if path == "masks" else None
    q, k, v = torch.cat(step.q), torch.cat(step.k), torch.cat(step.v)
    ref = attention.paged_attention(q, k, v, step.k_cache.clone(), step.v_cache.clone(), batch, SCALE, masks,
                                    window=window, softcap=softcap)
    out = attention.paged_attention(q, k, v, k8, v8, batch, SCALE, masks, window=window, softcap=softcap)
    # the rounding of k and v to int8 again on the write changes nothing (already on the grid,
    # up to float32's last bit in the scale); what remains is the order of the sums, and in
    # bf16 the result's rounding and the 16-bit kernel's bf16 probabilities
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * ref.float().abs() + 2 ** -6
    assert ((out.float() - ref.float()).abs() <= tol).all(), float((out.float() - ref.float()).abs().max())


def test_long_prompt_chunks_over_an_int8_cache_take_sdpa():
    """In a step of more than PROMPTS_ON_KERNEL_UP_TO tokens the int8 kernel (no prompt tiles)
    gives long prompt chunks to SDPA, over their own K/V (fresh) or their dequantized context:
    the same attention as the 16-bit cache of the same values."""
    from tessera.batch import build_forward_batch
    from tessera.layers import attention
    from tessera.scheduler import StepPlan
    from test_attention_window import BS, SCALE, Step
    step = Step(torch.float32, seed=5)
    step.k_cache = torch.zeros(step.k_cache.shape[0], 400 * BS, step.k_cache.shape[2])
    step.v_cache = torch.zeros_like(step.k_cache)
    step.free = iter(torch.randperm(400, generator=step.g).tolist())
    step.request(30, 1)
    step.request(0, 150)
    step.request(40, 140)
    k8, v8 = kv_int8.quantize_ref(step.k_cache), kv_int8.quantize_ref(step.v_cache)
    k_cache, v_cache = kv_int8.dequantize(k8, torch.float32), kv_int8.dequantize(v8, torch.float32)
    rounded = [torch.cat([kv_int8.dequantize(kv_int8.quantize_ref(x), torch.float32) for x in xs]) for xs in (step.k, step.v)]
    batch = build_forward_batch(StepPlan(tuple(step.entries)), BS)
    q = torch.cat(step.q)
    assert q.shape[0] > attention.PROMPTS_ON_KERNEL_UP_TO
    ref = attention.paged_attention(q, *rounded, k_cache, v_cache, batch, SCALE)
    out = attention.paged_attention(q, *rounded, k8, v8, batch, SCALE)
    assert (out - ref).abs().max() <= 1e-4


def test_an_int8_step_is_recorded_for_replay():
    """Every call of an int8 step is a C kernel's (the quantizing write and the int8 attention),
    so step_graph.py records and replays it (nothing in it runs eagerly), and the replay on new
    queries is their attention."""
    from tessera.batch import build_forward_batch
    from tessera.layers import attention
    from tessera.scheduler import StepPlan
    from tessera_kernels import replay
    from test_attention_window import BS, SCALE, Step
    step = Step(torch.float32, seed=3)
    step.request(45, 1)
    step.request(7, 1)
    step.request(0, 9)
    k8, v8 = kv_int8.quantize_ref(step.k_cache), kv_int8.quantize_ref(step.v_cache)
    batch = build_forward_batch(StepPlan(tuple(step.entries)), BS)
    q, k, v = torch.cat(step.q), torch.cat(step.k), torch.cat(step.v)
    with replay.record() as rec:
        out = attention.paged_attention(q, k, v, k8, v8, batch, SCALE)
    assert rec.refused is None and rec.calls
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(4)))
    expected = attention.paged_attention(q, k, v, k8.clone(), v8.clone(), batch, SCALE)
    rec.replay()
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def smollm2_f32():
    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    model, _ = load_model("smollm2", torch.float32)
    return model, load_tokenizer("smollm2")


def _logits(model, tokens, kv_dtype):
    from tessera.model_runner import ModelRunner
    from tessera.pipeline import quality
    runner = ModelRunner(model, -(-len(tokens) // 16), 16, kv_dtype=kv_dtype)
    x, _ = quality.hidden_states(model, tokens, runner=runner)
    return model.compute_logits(model.norm(x)).float()


def test_int8_cache_logits_close_to_the_model_dtype_cache(smollm2_f32):
    """A whole-prompt prefill attends row by row from the cache (the kernel's causal rows), so
    every position's logits read int8 K/V. Bound: the issue allows 1 % of perplexity, 0.01 nats
    of mean next-token log-likelihood; the KL divergence of each position's int8 distribution
    from the float32 cache's is held to that on average (measured: about 0.001) and to 0.05 at
    any position (measured: about 0.008); the greedy token agrees at 90 % of positions or more
    (measured: 97 %). A wrong scale or row moves the KL by orders of magnitude."""
    model, tok = smollm2_f32
    tokens = tok("The quick brown fox jumps over the lazy dog. " * 6 + "def main():\n    return 42\n")["input_ids"]
    ref = _logits(model, tokens, None).log_softmax(-1)
    got = _logits(model, tokens, torch.int8).log_softmax(-1)
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1)
    assert kl.mean() <= 0.01 and kl.max() <= 0.05, (kl.mean(), kl.max())
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _perplexity(model, windows, kv_dtype) -> float:
    from tessera.model_runner import ModelRunner
    from tessera.pipeline import quality
    nll, count = 0.0, 0
    for tokens in windows:
        runner = ModelRunner(model, -(-len(tokens) // 16), 16, kv_dtype=kv_dtype)
        x, _ = quality.hidden_states(model, tokens, runner=runner)
        logits = model.compute_logits(model.norm(x[:-1])).float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="sum").item()
        count += len(tokens) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_perplexity_within_one_percent(smollm2_f32, dtype):
    """Held-out perplexity (pipeline/quality.py's text, 2 windows of 160 tokens: the windows
    stay under the prompt length SDPA would take on AMX, so every row reads the cache)."""
    from tessera.pipeline import quality
    from tessera.models.loader import load_model
    model, tok = smollm2_f32
    if dtype != torch.float32:
        model, _ = load_model("smollm2", dtype)
    windows = quality.windows(tok, "heldout", 2, 160)
    base, int8 = _perplexity(model, windows, None), _perplexity(model, windows, torch.int8)
    assert abs(int8 / base - 1) <= 0.01, (base, int8)


def test_engine_sizes_and_runs_an_int8_cache(smollm2_engine):
    """--kv-cache-gib buys int8 rows (values and scale) in blocks: 64 + 4 bytes a row where the
    float32 cache takes 256, so 256/68 times the blocks; and the engine's greedy tokens (prompt,
    chunked prefill with a prefix hit, decode, replayed steps) are the 16-bit cache's for at
    least the first few tokens, where int8 changes the logits by a KL of about 0.001 (above)."""
    from tessera.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
    from tessera.engine import Engine
    gib = 0.05
    engine = Engine(EngineConfig(model="smollm2", dtype="float32",
                                 cache=CacheConfig(kv_cache_gib=gib, kv_cache_dtype="int8"),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=32)),
                    model=smollm2_engine.runner.model, tokenizer=smollm2_engine.tokenizer)
    assert engine.runner.kv_caches[0][0].dtype == torch.int8
    cfg = engine.model_config
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert engine.kv.num_blocks == int(gib * 2 ** 30 // per_block)
    prompt = smollm2_engine.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    sampling = SamplingParams(max_tokens=6, temperature=0)
    expected = smollm2_engine.generate([prompt], sampling)[0]
    first, again = engine.generate([prompt], sampling)[0], engine.generate([prompt], sampling)[0]   # again: a prefix hit
    assert first == again
    assert first[:3] == expected[:3], (first, expected)


def test_served_chat_with_int8_cache():
    openai = pytest.importorskip("openai")
    from servers import tessera_serve
    with tessera_serve("--kv-cache-dtype", "int8", "--kv-cache-gib", "0.05", "--dtype", "float32") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens > 0
