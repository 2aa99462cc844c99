"""Speculative decoding in one process: draft trees, the evolving tree cache, and the target
engine's tree verification give exactly what plain decoding gives
(docs/design/speculative.md#invariants)."""
from __future__ import annotations

import random

import pytest
import torch

from tessera.batch import ForwardBatch, PrefillChunk
from tessera.config import EngineConfig, SamplingParams, SpeculativeConfig
from tessera.engine import Engine
from tessera.layers.quant import Int4Linear, Int8Linear, layer_linears
from tessera.models.driver import run_layers
from tessera.models.loader import load_model
from tessera.models.random_init import write_random_model
from tessera.spec.draft_models import draft_model
from tessera.spec.drafter import TreeDrafter
from tessera.spec.ngram import NgramProposer
from tessera.spec.proposer import AsyncProposer, SerialProposer
from tessera.spec.tree import Draft, TokenTree

PROMPTS = [[1, 450, 3000, 17, 99, 4093, 8, 9, 10], [2000, 5, 6, 7, 11], [42, 42, 42, 31000, 12], [7]]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


def engine(path: str, draft: str | None = None, proposer=None, **spec) -> Engine:
    cfg = EngineConfig(model=path, dtype="float32", speculative=SpeculativeConfig(draft=draft, **spec))
    return Engine(cfg, proposer=proposer)


def run(e: Engine, prompts, sampling: SamplingParams) -> tuple[list[list[int]], list[str], list]:
    """Each prompt alone (batch 1, where speculation runs): token ids, texts, finish reasons."""
    ids, texts, reasons = [], [], []
    for p in prompts:
        rid = e.add_request(p, sampling)
        toks, text, last = [], "", None
        while e.has_unfinished:
            for out in e.step():
                assert out.request_id == rid and out.error is None
                toks += out.new_token_ids
                text += out.new_text
                last = out
        ids.append(toks), texts.append(text), reasons.append(last.finish_reason)
    return ids, texts, reasons


def draft_sizes(path):
    n = load_model(path, torch.float32)[0].config.num_layers
    return [f"self:{n}", "self:1"]     # a perfect draft (the target itself) and a poor one


# -- the tree ----------------------------------------------------------------------------------

def random_tree(seed: int, nodes: int = 40) -> TokenTree:
    rng = random.Random(seed)
    tree = TokenTree.rooted_at(5)
    for _ in range(nodes):
        parent = rng.randrange(len(tree))
        tree.add(parent, rng.randrange(100), -rng.random() * 3)
    return tree


@pytest.mark.parametrize("seed", range(5))
def test_best_subtree_is_rooted_ancestor_closed_and_the_heaviest(seed):
    tree = random_tree(seed)
    for size in (1, 4, 8, 17):
        nodes = tree.best(size)
        assert nodes[0] == 0 and len(nodes) == min(size, len(tree))
        assert all(tree.parents[n] in nodes for n in nodes[1:])
        lightest_in = min(tree.weights[n] for n in nodes)
        assert all(tree.weights[n] <= lightest_in for n in range(len(tree)) if n not in nodes)
        draft = tree.draft(nodes)
        assert draft.depths()[1:] == [tree.depths[n] for n in nodes[1:]]


def test_reroot_keeps_the_subtree_with_relative_weights_and_depths():
    tree = random_tree(0)
    node = max(range(1, len(tree)), key=lambda n: len(tree.subtree(n)))
    new, old = tree.reroot(node)
    assert old[0] == node and new.tokens == [tree.tokens[n] for n in old]
    for i, n in enumerate(old):
        assert new.depths[i] == tree.depths[n] - tree.depths[node]
        assert new.weights[i] == pytest.approx(tree.weights[n] - tree.weights[node])


def test_prompt_lookup_merges_what_followed_each_repeated_suffix():
    ngram = NgramProposer(max_n=3, min_n=2)
    # "5 6" occurred twice before the end: after it came 7 8 9 (newest first) and 1 2
    seq = [5, 6, 1, 2, 3, 5, 6, 7, 8, 9, 4, 5, 6]
    draft = ngram.propose("r", seq, len(seq), size=8)
    assert draft.tokens == (7, 8, 9, 4, 5, 6, 1) and draft.parents == (0, 1, 2, 3, 4, 5, 0)
    assert len(ngram.propose("r", seq, len(seq), size=4)) == 3          # the tree-size bound, root included
    # only single tokens repeat (no repeated pair): nothing worth verifying
    assert ngram.propose("r", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 11, size=8) is None
    assert NgramProposer(min_n=1).propose("r", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 11, size=8) is not None


def test_malformed_drafts_are_refused():
    with pytest.raises(ValueError):
        Draft((1, 2), (0,))
    with pytest.raises(ValueError):
        Draft((1, 2), (0, 2))          # a parent after its child


# -- the evolving tree cache ---------------------------------------------------------------

def linear_kv(model, layers, tokens: list[int]) -> list[torch.Tensor]:
    """K of every layer for `tokens` run as one causal sequence from position 0."""
    cfg = model.config
    kv = [(torch.zeros(cfg.num_kv_heads, len(tokens), cfg.head_dim),) * 2 if l in layers else None
          for l in range(cfg.num_layers)]
    kv = [None if x is None else (x[0].clone(), x[1].clone()) for x in kv]
    n = len(tokens)
    empty = torch.zeros(0, dtype=torch.long)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(n), torch.arange(n), empty, empty.view(0, 0),
                         empty, torch.zeros(0, 0, dtype=torch.bool), [PrefillChunk(0, n, 0, None, None)],
                         torch.arange(n), 1)
    run_layers(model, model.embed_tokens(batch.input_ids), batch, kv, layers)
    return [kv[l][0] for l in layers]


def check_cache(d: TreeDrafter, verified: list[int]) -> None:
    """Slots [0, P) hold the verified tokens' KV; each expanded node's slot holds the KV of
    the sequence prefix + its path from the root, recomputed from scratch."""
    assert d.prefix == len(verified) and not d.pending
    ref = linear_kv(d.model, d.layers, verified) if verified else None
    for li, l in enumerate(d.layers):
        if ref is not None:
            torch.testing.assert_close(d.kv[l][0][:, :d.prefix], ref[li], rtol=0, atol=1e-5)
    for node, slot in d.slot.items():
        path, a = [], node
        while a != -1:
            path.append(d.tree.tokens[a])
            a = d.tree.parents[a]
        full = linear_kv(d.model, d.layers, verified + path[::-1])
        for li, l in enumerate(d.layers):
            torch.testing.assert_close(d.kv[l][0][:, slot], full[li][:, -1], rtol=0, atol=1e-5)


@torch.inference_mode()
def test_tree_cache_equals_recomputation_after_every_round(llama, monkeypatch):
    """Rounds that hit (the target emits a path the tree holds, re-rooted without
    recomputation) and rounds that miss (a token the tree lacks): after each, the draft's KV is
    [verified prefix | live tree] exactly as a from-scratch recomputation gives it. The
    expansions attend through the paged kernel (each row over its mask's slots, one-slot
    blocks); the recomputation through SDPA."""
    from tessera_kernels import paged_attention_cpu
    kernel, rows = paged_attention_cpu.paged_decode_attention, []
    monkeypatch.setattr(paged_attention_cpu, "paged_decode_attention",
                        lambda *args: rows.append((args[0].shape[0], args[-2])) or kernel(*args))
    model = load_model(llama, torch.float32)[0]
    d = TreeDrafter(model, range(len(model.layers)), 256, width=3)
    seq = list(PROMPTS[0])
    d.start(seq)
    rng = random.Random(0)
    hits = 0
    for round_ in range(8):
        for _ in range(3):
            d.expand()
        nodes = d.tree.best(8)
        leaf = rng.choice(nodes)
        path, a = [], leaf
        while a > 0:
            path.append(d.tree.tokens[a])
            a = d.tree.parents[a]
        emitted = path[::-1] + ([rng.randrange(40000)] if round_ % 3 == 2 else [])
        emitted = emitted or [rng.randrange(40000)]
        hits += d.reroot(emitted)
        seq += emitted
        d.expand()
        check_cache(d, seq[:-1])
        assert d.tree.tokens[0] == seq[-1]
    assert 0 < hits < 8
    if paged_attention_cpu.available():      # every layer of every expansion, one-slot blocks
        assert len(rows) >= 8 * 4 * len(model.layers) and {bs for _, bs in rows} == {1}
        assert rows[0][0] == len(PROMPTS[0])  # the first: the prompt's pending tokens and the root


def test_tree_cache_grows_for_a_long_context_and_stays_exact(llama):
    """A 300-token context outgrows the first allocation (256 slots) inside an expansion; the
    grown cache is then re-rooted along the root's third child (its KV moves: a real gather),
    outside inference mode as the proposers call it, and stays exact."""
    model = load_model(llama, torch.float32)[0]
    d = TreeDrafter(model, range(len(model.layers)), 1024, width=3)
    rng = random.Random(1)
    seq = [rng.randrange(40000) for _ in range(300)]
    d.start(seq)
    d.expand(), d.expand()                     # the root, then its three children
    third = max(n for n in d.tree.kids[0].values() if n in d.slot)
    emitted = [d.tree.tokens[third], 7]
    assert d.slot[third] != d.prefix + 1
    d.reroot(emitted)
    seq += emitted
    d.expand()
    with torch.inference_mode():
        check_cache(d, seq[:-1])


# -- the target engine: lossless output -------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 24])
def test_greedy_speculation_equals_plain_decoding(llama, max_tokens):
    """Token for token, with a perfect and a poor draft, max_tokens landing anywhere in an
    accepted path; the perfect draft must actually be accepted."""
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = run(engine(llama), PROMPTS, sampling)
    for draft in draft_sizes(llama):
        spec = engine(llama, draft)
        assert run(spec, PROMPTS, sampling) == plain, draft
        if draft != "self:1" and max_tokens > 2:
            assert spec.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("draft", ["self@int4", "self:1@int8"])
def test_quantized_copies_of_the_target_draft_losslessly(llama, draft):
    sampling = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    plain = run(engine(llama), PROMPTS, sampling)
    spec = engine(llama, draft)
    assert run(spec, PROMPTS, sampling) == plain
    if draft == "self@int4":    # all layers, 4-bit: on random weights it still often agrees
        assert spec.spec_stats.acceptance_length > 1.5, spec.spec_stats    # 1.85 here; useless: 1.0


def test_a_quantized_draft_copies_only_its_layers_and_leaves_the_target_alone(llama):
    target = load_model(llama, torch.float32)[0]
    draft, layers = draft_model("self:1@int4", target, torch.float32)
    assert layers == range(1) and len(draft.layers) == 1 and len(target.layers) > 1
    assert all(isinstance(m, Int4Linear) for _, m in layer_linears(draft.layers[0]))
    assert isinstance(draft.lm_head, Int4Linear)
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in target.modules())


def test_stop_tokens_and_strings_inside_an_accepted_path(llama):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids, texts, _ = run(engine(llama), PROMPTS[:1], base)
    stop_id, stop_str = ids[0][9], texts[0][len(texts[0]) // 2:len(texts[0]) // 2 + 3]
    for sampling in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_id,)),
                     SamplingParams(temperature=0, max_tokens=24, stop=(stop_str,)),
                     SamplingParams(temperature=0, max_tokens=24, stop=(stop_str,), include_stop_str_in_output=True)):
        plain = run(engine(llama), PROMPTS[:1], sampling)
        assert plain[2] == ["stop"]
        assert run(engine(llama, draft_sizes(llama)[0]), PROMPTS[:1], sampling) == plain


SEEDED = [SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.2, top_p=0.9, top_k=50, min_p=0.02, seed=123, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                         seed=-5, max_tokens=20, min_tokens=5, logprobs=2)]


@pytest.mark.parametrize("sampling", SEEDED)
def test_seeded_sampling_emits_exactly_the_plain_draws(llama, sampling):
    plain = run(engine(llama), PROMPTS, sampling)
    spec = engine(llama, draft_sizes(llama)[0])
    assert run(spec, PROMPTS, sampling) == plain
    assert spec.spec_stats.accepted_tokens > 0


def test_logprobs_match_plain_decoding(llama):
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = {}
    for name, e in (("plain", engine(llama)), ("spec", engine(llama, draft_sizes(llama)[0]))):
        rid = e.add_request(PROMPTS[0], sampling)
        outs[name] = [lp for o in iter_outputs(e) for lp in o.logprobs]
    assert [lp.token_id for lp in outs["spec"]] == [lp.token_id for lp in outs["plain"]]
    for a, b in zip(outs["spec"], outs["plain"]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def iter_outputs(e: Engine):
    while e.has_unfinished:
        yield from e.step()


def test_unseeded_sampling_has_the_target_distribution(tmp_path):
    """Vocabulary of 6: the joint law of the first three output tokens from 3000 unseeded
    speculative generations against the target's exact probabilities (chi-square)."""
    path = str(write_random_model("llama", tmp_path / "v6", seed=3, vocab_size=6))
    sampling = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    spec = engine(path, "self:2", disable_batch_size=10_000, tree_size=4, width=2, depth=1)
    prompt = [1, 4, 0]
    counts = torch.zeros(6, 6, 6)
    for _ in range(3):                   # the waiting queue holds 1024
        for out in spec.generate([prompt] * 1000, sampling):
            counts[tuple(out)] += 1
    assert spec.spec_stats.accepted_tokens > 300 and spec.scheduler.requests == {}
    probs = exact_joint(path, prompt)
    expected = probs * counts.sum()
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum().item()
    dof = int(keep.sum()) - 1
    # the 0.999 quantile of chi-square (Wilson-Hilferty); a correct sampler fails 1 run in 1000
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < limit, (chi2, limit, dof)


@torch.inference_mode()
def exact_joint(path: str, prompt: list[int]) -> torch.Tensor:
    e = engine(path)
    model = e.runner.model

    def next_probs(seq):
        n = len(seq)
        empty = torch.zeros(0, dtype=torch.long)
        batch = ForwardBatch(torch.tensor(seq), torch.arange(n), torch.arange(n), empty, empty.view(0, 0), empty,
                             torch.zeros(0, 0, dtype=torch.bool), [PrefillChunk(0, n, 0, None, None)],
                             torch.tensor([n - 1]), 1)
        cfg = model.config
        kv = [(torch.zeros(cfg.num_kv_heads, n, cfg.head_dim), torch.zeros(cfg.num_kv_heads, n, cfg.head_dim))
              for _ in range(cfg.num_layers)]
        x = run_layers(model, model.embed_tokens(batch.input_ids), batch, kv)
        return torch.softmax(model.compute_logits(model.norm(x[-1:]))[0], -1)
    joint = torch.zeros(6, 6, 6)
    p1 = next_probs(prompt)
    for a in range(6):
        p2 = next_probs(prompt + [a])
        for b in range(6):
            joint[a, b] = p1[a] * p2[b] * next_probs(prompt + [a, b])
    return joint


# -- concurrency and the asynchronous proposer ------------------------------------------------

def test_busy_batches_fall_back_to_plain_decoding_with_the_same_outputs(llama):
    """Above disable_batch_size running requests the target decodes plainly; when the short
    requests finish, the long one speculates again; outputs equal plain decoding either way."""
    plain = engine(llama)
    prompts = PROMPTS[:3]
    lengths = [4, 6, 30]
    want = [plain.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(prompts, lengths)]
    spec = engine(llama, draft_sizes(llama)[0], disable_batch_size=1)
    rids = [spec.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    got = {r: [] for r in rids}
    accepted = dict.fromkeys(rids, 0)
    tree_steps_while_busy = 0
    for out in iter_outputs(spec):
        got[out.request_id] += out.new_token_ids
        assert out.accepted_tokens >= accepted[out.request_id]    # plain steps keep the running count
        accepted[out.request_id] = out.accepted_tokens
        busy = len(spec.scheduler.running) > 1
        tree_steps_while_busy += busy and len(out.new_token_ids) > 1
    assert [got[r] for r in rids] == want
    assert tree_steps_while_busy == 0
    assert spec.spec_stats.accepted_tokens > 0


def test_async_proposer_gives_the_same_greedy_output(llama):
    """The draft worker's proposer (trees grown on a thread between rounds), in process."""
    plain = run(engine(llama), PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    model = load_model(llama, torch.float32)[0]
    cfg = SpeculativeConfig(draft="self:2", depth=3)
    proposer = AsyncProposer(model, range(len(model.layers)), cfg, 2048)
    try:
        got = run(engine(llama, "self:2", proposer=proposer), PROMPTS,
                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        proposer.close()
    assert got == plain
    assert proposer.stats.expansions > 0 and proposer.stats.hits > 0


class BrokenProposer(SerialProposer):
    def propose(self, request_id, token_ids, num_new, size):
        raise ConnectionError("draft worker gone")


def test_a_failing_proposer_means_plain_decoding_not_an_error(llama):
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    model = load_model(llama, torch.float32)[0]
    broken = BrokenProposer(model, range(2), SpeculativeConfig(draft="self:2"), 2048)
    assert run(engine(llama, "self:2", proposer=broken), PROMPTS, sampling) == run(engine(llama), PROMPTS, sampling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_in_the_paged_kernel_equal_sdpa_with_the_tree_mask(dtype, monkeypatch):
    """A verification's draft tree runs through the paged kernel (each node a row over its own
    slots, one-slot blocks); given its mask explicitly, the same chunk takes SDPA: both must agree."""
    from tessera.batch import build_forward_batch
    from tessera.layers.attention import paged_attention
    from tessera.scheduler import ScheduledRequest, StepPlan
    from tessera_kernels import paged_attention_cpu
    if not paged_attention_cpu.available():
        pytest.skip("no C compiler for the paged kernel")
    g = torch.Generator().manual_seed(3)
    H, KV, D, bs, context = 6, 2, 64, 16, 37
    parents = tuple(random.Random(5).randrange(i + 1) for i in range(8))   # node i + 1's parent
    entry = ScheduledRequest("r", tuple(range(9)), context, (7, 3, 10, 8), True, tree_parents=parents)
    batch = build_forward_batch(StepPlan((entry,)), bs)
    T = batch.num_tokens
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, KV, KV))
    caches = [torch.randn(KV, 12 * bs, D, generator=g).to(dtype) for _ in range(2)]
    kernel, block_sizes = paged_attention_cpu.paged_decode_attention, []
    monkeypatch.setattr(paged_attention_cpu, "paged_decode_attention",
                        lambda *args: block_sizes.append(args[-2]) or kernel(*args))
    by_kernel = paged_attention(q, k, v, *(c.clone() for c in caches), batch, D ** -0.5)
    assert block_sizes == [1]                                   # the tree's rows, in one call
    by_sdpa = paged_attention(q, k, v, *(c.clone() for c in caches), batch, D ** -0.5, [batch.prefills[0].mask])
    assert block_sizes == [1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(by_kernel.float(), by_sdpa.float(), atol=tol, rtol=tol)
