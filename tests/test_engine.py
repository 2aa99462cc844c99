"""Engine behaviour: batch invariance, seeded sampling, preemption, abort, stop conditions."""
from __future__ import annotations

from tessera.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from tessera.engine import Engine

TEXTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,",
         "List three colors:", "1, 2, 3, 4,", "The quick brown fox",
         "Photosynthesis is the process by which green plants", "Hello! My name is"]


def prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer(t)["input_ids"] for t in TEXTS]


def run_one_at_a_time(engine: Engine, ps, sp) -> list[list[int]]:
    return [engine.generate([p], sp)[0] for p in ps]


def test_batch_invariance_greedy(smollm2_engine):
    e = smollm2_engine
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = prompts(e)
    assert e.generate(ps, sp) == run_one_at_a_time(e, ps, sp)
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_seeded_sample_same_alone_and_in_batch(smollm2_engine):
    e = smollm2_engine
    ps = prompts(e)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = e.generate([ps[0]], seeded)[0]
    rid = e.add_request(ps[0], seeded)
    others = [e.add_request(p, SamplingParams(temperature=1.0, max_tokens=20)) for p in ps[1:]]
    out = {rid: []} | {o: [] for o in others}
    while e.has_unfinished:
        for o in e.step():
            out[o.request_id].extend(o.new_token_ids)
    assert out[rid] == alone
    assert e.generate([ps[0]], SamplingParams(temperature=0.9, seed=99, max_tokens=20, ignore_eos=True))[0] != alone


def test_preempted_request_gives_same_tokens(tiny_models):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = Engine(EngineConfig(model=tiny_models["llama"], dtype="float32",
                                cache=CacheConfig(block_size=4, num_blocks=256)))
    tight = Engine(EngineConfig(model=tiny_models["llama"], dtype="float32",
                                cache=CacheConfig(block_size=4, num_blocks=24)))
    ps = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [300, 301, 302, 303, 304, 305, 306]]
    expected = roomy.generate(ps, sp)
    got = tight.generate(ps, sp)
    assert got == expected
    assert tight.kv.num_free_blocks == tight.kv.num_blocks
    # the tight cache (24 blocks of 4 = 96 slots < 3 x 52 tokens) must really have preempted
    ids = [tight.add_request(p, sp) for p in ps]
    reqs = [tight.scheduler.requests[i] for i in ids]
    while tight.has_unfinished:
        tight.step()
    preemptions = sum(r.num_preemptions for r in reqs)
    assert preemptions > 0


def test_abort_frees_blocks_at_once(smollm2_engine):
    e = smollm2_engine
    rid = e.add_request(prompts(e)[2], SamplingParams(temperature=0, max_tokens=50))
    e.step()
    e.step()
    assert e.kv.num_free_blocks < e.kv.num_blocks
    assert e.abort(rid)
    assert e.kv.num_free_blocks == e.kv.num_blocks and not e.has_unfinished


def test_stop_string_min_tokens_and_length(smollm2_engine):
    e = smollm2_engine
    p = e.tokenizer("1, 2, 3, 4,")["input_ids"]
    full = e.tokenizer.decode(e.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0])
    stop = full.strip()[3:5]
    rid = e.add_request(p, SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    text, reason = "", None
    while e.has_unfinished:
        for o in e.step():
            text += o.new_text
            reason = o.finish_reason or reason
    assert reason == "stop" and stop not in text and full.startswith(text)
    out = e.generate([p], SamplingParams(temperature=0, max_tokens=5, min_tokens=5))
    assert len(out[0]) == 5


def test_chunked_prefill_matches_single_prefill(tiny_models):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    p = list(range(100, 160))
    whole = Engine(EngineConfig(model=tiny_models["qwen2_moe"], dtype="float32"))
    chunked = Engine(EngineConfig(model=tiny_models["qwen2_moe"], dtype="float32",
                                  scheduler=SchedulerConfig(max_num_batched_tokens=7)))
    assert whole.generate([p], sp) == chunked.generate([p], sp)


def test_finished_outputs_say_where_the_request_spent_its_time(tiny_models):
    """One request at a time (max_num_seqs 1), both received at the same moment: the first is
    scheduled and makes its first token in step 0 and finishes in step 2; the second waits
    (queue) until step 3, makes its first token there and finishes in step 5. Each phase's end
    must fall inside the step that ends it, as timed around engine.step(). The worker received
    them half a second before the engine did (its tokenizer, its inbox): queue counts from then."""
    import time
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(max_num_seqs=1))
    e = Engine(cfg)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    arrival = time.monotonic() - 0.5
    for rid in ("first", "second"):
        e.add_request([5, 6, 7], sp, rid, arrival_time=arrival)
    steps, timings = [], {}
    while e.has_unfinished:
        before = time.monotonic()
        outs = e.step()
        steps.append((before, time.monotonic()))
        for o in outs:
            assert (o.timings is not None) == o.finished
            if o.finished:
                timings[o.request_id] = o.timings

    def within(t: float, step: int) -> bool:
        return steps[step][0] <= t <= steps[step][1]
    assert len(steps) == 6
    for rid, first_step in (("first", 0), ("second", 3)):
        t = timings[rid]
        scheduled = arrival + t.queue_time_s
        assert within(scheduled, first_step) and within(scheduled + t.prefill_time_s, first_step), (rid, t, steps)
        assert within(scheduled + t.prefill_time_s + t.decode_time_s, first_step + 2), (rid, t, steps)
    assert timings["second"].queue_time_s > timings["first"].prefill_time_s + timings["first"].decode_time_s
