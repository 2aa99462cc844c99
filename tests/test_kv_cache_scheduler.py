"""Block accounting, prefix caching and scheduling order with exact block ids (plain Python,
no model)."""
from __future__ import annotations

import hashlib
import struct

import pytest

from tessera.config import SamplingParams, SchedulerConfig
from tessera.kv_cache import BlockAllocator, KVCacheManager, block_hashes
from tessera.request import Request, RequestStatus
from tessera.scheduler import Scheduler


def make(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8))


def test_allocator_free_list_and_ref_counts():
    a = BlockAllocator(3)
    assert [a.allocate(), a.allocate()] == [0, 1]
    a.incref(0)
    a.free(0)
    assert a.num_free == 1 and a.ref_count(0) == 1
    a.free(0)
    assert a.num_free == 2
    with pytest.raises(ValueError):
        a.free(0)
    assert [a.allocate(), a.allocate()] == [2, 0]
    with pytest.raises(MemoryError):
        a.allocate()


def test_manager_grows_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 5) and kv.block_tables["a"] == [0, 1]
    assert kv.allocate("a", 8) and kv.block_tables["a"] == [0, 1]
    assert not kv.allocate("b", 12)          # needs 3, only 2 free: nothing taken
    assert "b" not in kv.block_tables and kv.num_free_blocks == 2
    assert kv.allocate("a", 9) and kv.block_tables["a"] == [0, 1, 2]
    kv.free("a")
    assert kv.num_free_blocks == 4


def test_chunked_prefill_respects_token_budget():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4), kv)
    s.add(make("a", 10))
    s.add(make("b", 3))
    plan = s.schedule()
    assert [(e.request_id, len(e.token_ids), e.start_pos, e.sample) for e in plan.scheduled] == [("a", 8, 0, False)]
    assert kv.block_tables["a"] == [0, 1]
    s.on_step_done(plan)
    plan = s.schedule()
    assert [(e.request_id, len(e.token_ids), e.start_pos, e.sample) for e in plan.scheduled] == \
        [("a", 2, 8, True), ("b", 3, 0, True)]
    assert kv.block_tables == {"a": [0, 1, 2], "b": [3]}


def test_preempted_request_is_recomputed_first_when_blocks_return():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)   # with it: below
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv)
    a, b = make("a", 4), make("b", 4)
    s.add(a)
    s.add(b)
    s.on_step_done(s.schedule())             # a: block 0, b: block 1
    a.append_output(7)
    b.append_output(8)
    plan = s.schedule()                      # a takes block 2; b finds none and is preempted
    assert [e.request_id for e in plan.scheduled] == ["a"] and plan.preempted == ("b",)
    assert kv.block_tables == {"a": [0, 2]} and kv.num_free_blocks == 1
    s.on_step_done(plan)
    s.add(make("c", 2))
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    plan = s.schedule()                      # b (front of the queue) recomputes prompt + output
    assert [(e.request_id, e.token_ids, e.start_pos) for e in plan.scheduled] == \
        [("b", (1, 2, 3, 4, 8), 0), ("c", (1, 2), 0)]
    assert kv.block_tables == {"b": [1, 2], "c": [0]}   # free list is FIFO: 1, then a's 2, 0


def test_preemption_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv)
    a, b = make("a", 4), make("b", 4)
    s.add(a)
    s.add(b)
    s.on_step_done(s.schedule())
    a.append_output(7)
    b.append_output(8)
    plan = s.schedule()
    assert plan.preempted == ("b",)
    assert [e.request_id for e in plan.scheduled] == ["a"]
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING and s.waiting[0] is b
    assert kv.block_tables == {"a": [0, 1]}


def test_finish_and_abort_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4), kv)
    s.add(make("a", 9))
    s.add(make("b", 2))
    s.on_step_done(s.schedule())
    assert kv.num_free_blocks == 7
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("b", RequestStatus.FINISHED_ABORTED)   # still waiting: no blocks yet
    assert kv.num_free_blocks == 8 and not s.has_work


def test_max_num_seqs_caps_running():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), kv)
    for i in range(3):
        s.add(make(f"r{i}", 2))
    plan = s.schedule()
    assert [e.request_id for e in plan.scheduled] == ["r0", "r1"] and len(s.waiting) == 1


# -- automatic prefix caching -------------------------------------------------------------------

def test_block_hashes_chain_over_the_whole_prefix():
    root = b"salt"
    h = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2, root)      # two full blocks; token 9 is not one
    assert h[0] == hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert h[1] == hashlib.sha256(h[0] + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2, root)[1] != h[1]   # same tokens, other prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, b"other salt")[0] != h[0]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, root, done=h[:1]) == h
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, b"x", done=h) == h   # computed names are kept


def test_shared_prefix_hits_full_computed_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = list(range(1, 11))                     # two full blocks and two tokens
    assert kv.find_cached("a", a) == [] and kv.allocate("a", 10) and kv.block_tables["a"] == [0, 1, 2]
    kv.commit("a", a, 3)                       # block 0 not computed to its end yet
    assert not kv.allocator.cached(0)
    kv.commit("a", a, 10)
    assert [kv.allocator.cached(b) for b in (0, 1, 2)] == [True, True, False]   # a partial block never is
    b = a[:8] + [50, 51, 52]
    assert kv.find_cached("b", b) == [0, 1]
    assert kv.find_cached("c", a[:4] + [99] * 6) == [0]
    assert kv.find_cached("d", [0] + a[1:]) == []           # chained: a different first token, no hit
    assert kv.find_cached("e", a[:8]) == [0]                 # the last token is always computed
    assert kv.find_cached("f", a[:9]) == [0, 1]
    assert kv.allocate("b", 11, [0, 1]) and kv.block_tables["b"] == [0, 1, 3]
    assert [kv.allocator.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert not kv.writable("b", 0, 11) and not kv.writable("b", 7, 9) and kv.writable("b", 8, 11)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and [kv.allocator.ref_count(i) for i in range(4)] == [0, 0, 0, 0]


def test_eviction_takes_fresh_blocks_first_then_the_least_recently_released():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    for rid, tokens in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        assert kv.allocate(rid, 4)
        kv.commit(rid, tokens, 4)
    assert kv.block_tables == {"a": [0, 1], "b": [2, 3]}
    kv.free("a")                               # a request releases its tail first: LRU 1, 0,
    kv.free("b")                               # then 3, 2; block 4 was never used
    assert kv.num_free_blocks == 5 and kv.allocator.num_cached == 4
    assert kv.allocate("c", 4) and kv.block_tables["c"] == [4, 1]   # fresh, then evict a's tail
    assert kv.find_cached("x", [1, 2, 3, 4, 0]) == [0]               # a's head outlived its tail
    kv.free("c")                               # 1 (its hash evicted) and 4 hold nothing: fresh again
    assert kv.allocate("d", 8) and kv.block_tables["d"] == [1, 4, 0, 3]
    assert kv.find_cached("y", [1, 2, 0]) == [] and kv.find_cached("z", [5, 6, 0]) == [2]
    assert kv.allocator.num_cached == 1


def test_a_cached_block_outlives_its_owner_and_is_shared_again():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    p = list(range(1, 10))
    assert kv.allocate("a", 9) and kv.block_tables["a"] == [0, 1, 2]
    kv.commit("a", p, 9)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.allocator.num_cached == 2
    hit = kv.find_cached("b", p[:8] + [20, 21])
    assert hit == [0, 1] and kv.allocate("b", 10, hit) and kv.block_tables["b"] == [0, 1, 3]
    assert kv.allocate("c", 9, kv.find_cached("c", p)) and kv.block_tables["c"] == [0, 1, 2]
    assert [kv.allocator.ref_count(i) for i in range(4)] == [2, 2, 1, 1] and kv.num_free_blocks == 0
    kv.free("b")
    assert [kv.allocator.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    kv.free("c")
    assert kv.num_free_blocks == 4 and kv.find_cached("d", p) == [0, 1]


def test_a_hit_on_free_cached_blocks_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    p = [1, 2, 3, 4, 5]
    assert kv.allocate("a", 5) and kv.block_tables["a"] == [0, 1]
    kv.commit("a", p, 5)
    kv.free("a")                               # 1 holds nothing (fresh), 0 is cached
    assert kv.allocate("x", 8) and kv.block_tables["x"] == [2, 1]
    hit = kv.find_cached("b", p)
    assert hit == [0] and kv.num_free_blocks == 1
    assert not kv.allocate("b", 5, hit)        # block 0 leaves the free pool: no room for the second
    assert "b" not in kv.block_tables and kv.allocator.ref_count(0) == 0 and kv.num_free_blocks == 1
    kv.free("x")
    assert kv.allocate("b", 5, hit) and kv.block_tables["b"] == [0, 1]


def test_two_copies_of_one_prefix_cache_one_and_free_the_other():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    for rid in ("a", "b"):                     # computed in the same step: neither could share
        assert kv.allocate(rid, 3)
        kv.commit(rid, [7, 8, 9], 3)
    assert kv.block_tables == {"a": [0, 1], "b": [2, 3]} and kv.allocator.num_cached == 1
    assert kv.find_cached("c", [7, 8, 9]) == [0]
    kv.free("a")
    kv.free("b")
    # fresh: a's partial 1, b's 3 and b's copy 2 (never cached); then the cached 0
    assert kv.allocate("d", 8) and kv.block_tables["d"] == [1, 3, 2, 0]


def test_blocks_are_shared_only_under_the_same_cache_salt():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    p = [1, 2, 3, 4, 5]
    for rid, salt in (("a", None), ("b", "tenant-b")):
        assert kv.allocate(rid, 5, kv.find_cached(rid, p, salt))
        kv.commit(rid, p, 5, salt)
    assert kv.block_tables == {"a": [0, 1, 2], "b": [3, 4, 5]} and kv.allocator.num_cached == 4
    assert kv.find_cached("c", p) == [0, 1] and kv.find_cached("d", p, "tenant-b") == [3, 4]
    assert kv.find_cached("e", p, "tenant-e") == [] and kv.find_cached("f", p, "") == [0, 1]   # "": none


def test_disabled_or_reset_prefix_cache_hits_nothing():
    off = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    assert off.allocate("a", 4)
    off.commit("a", [1, 2, 3, 4], 4)
    off.record_lookup(4, 0)
    assert off.allocator.num_cached == 0 and off.find_cached("b", [1, 2, 3, 4, 5]) == []
    assert (off.stats.queries, off.stats.hits) == (0, 0)
    kv = KVCacheManager(num_blocks=4, block_size=2)
    assert kv.allocate("a", 4)
    kv.commit("a", [1, 2, 3, 4], 4)
    kv.free("a")
    kv.reset_prefix_cache()                    # a pipeline stage lost its KV: the names are void
    assert kv.find_cached("b", [1, 2, 3, 4, 5]) == [] and kv.allocator.num_cached == 0
    assert kv.allocate("c", 8) and kv.block_tables["c"] == [2, 3, 1, 0]


def test_admission_starts_past_the_cached_prefix_outside_the_token_budget():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4), kv)
    system = list(range(1, 11))                # a shared "system prompt": two full blocks
    a = Request("a", system + [11, 12], SamplingParams(max_tokens=8))
    s.add(a)
    s.on_step_done(s.schedule())               # a: blocks 0, 1, 2, all computed and full
    assert a.num_cached_tokens == 0 and kv.allocator.num_cached == 3
    a.append_output(5)
    b = Request("b", system + [13], SamplingParams(max_tokens=8))
    s.add(b)
    plan = s.schedule()
    assert [(e.request_id, e.token_ids, e.start_pos, e.block_table) for e in plan.scheduled] == \
        [("a", (5,), 12, (0, 1, 2, 3)), ("b", (9, 10, 13), 8, (0, 1, 4))]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert (kv.stats.queries, kv.stats.hits) == (12 + 11, 8)
    s.on_step_done(plan)
    assert b.num_computed_tokens == 11 and kv.allocator.ref_count(0) == 2


def test_a_preempted_request_comes_back_through_the_cache():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv)
    a, b = make("a", 4), make("b", 4)
    s.add(a)
    s.add(b)
    s.on_step_done(s.schedule())               # same prompt, same step: only a's copy is cached
    a.append_output(7)
    b.append_output(8)
    plan = s.schedule()
    assert [e.request_id for e in plan.scheduled] == ["a"] and plan.preempted == ("b",)
    s.on_step_done(plan)
    s.add(make("c", 2))
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    plan = s.schedule()                        # b recomputes only its output token, over a's block 0
    assert [(e.request_id, e.token_ids, e.start_pos) for e in plan.scheduled] == [("b", (8,), 4), ("c", (1, 2), 0)]
    assert kv.block_tables == {"b": [0, 1], "c": [2]}
    assert b.num_cached_tokens == 0 and b.num_preemptions == 1    # reported as at its first admission
    assert (kv.stats.queries, kv.stats.hits) == (4 + 4 + 5 + 2, 4)


def test_core_modules_import_no_torch():
    import subprocess
    import sys
    code = ("import sys; import tessera.request, tessera.kv_cache, tessera.scheduler; "
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
