"""Block accounting and scheduling order with exact block ids (plain Python, no model)."""
from __future__ import annotations

import pytest

from tessera.config import SamplingParams, SchedulerConfig
from tessera.kv_cache import BlockAllocator, KVCacheManager
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
    kv = KVCacheManager(num_blocks=3, block_size=4)
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


def test_core_modules_import_no_torch():
    import subprocess
    import sys
    code = ("import sys; import tessera.request, tessera.kv_cache, tessera.scheduler; "
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
