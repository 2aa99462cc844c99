"""Continuous-batching scheduler (plain Python, no torch).

One rule, as in vLLM v1: each step, every scheduled request computes
num_tokens - num_computed_tokens of its tokens, capped by a per-step token budget (chunked
prefill). Running requests go first, oldest first; when KV blocks run out the newest running
request is preempted by recompute (blocks freed, num_computed_tokens reset to 0, back to the
front of the queue). Waiting requests are admitted only in steps that preempted nothing; an
admitted request starts with the longest run of its leading full blocks that the prefix cache
holds (shared, and counted as computed), and its full blocks join the cache once computed.
The output is a StepPlan: plain, serializable data that the model runner turns into tensors.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tessera.config import SchedulerConfig
from tessera.kv_cache import KVCacheManager
from tessera.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]     # the tokens to compute this step
    start_pos: int                 # position of token_ids[0]
    block_table: tuple[int, ...]
    sample: bool                   # True when this chunk reaches the end of the request
    tree_parents: tuple[int, ...] = ()  # a draft tree after token_ids[0]: see spec/tree.Draft
    prompt_len: int = 0            # the request's prompt tokens (RoPE scaling that depends on them); 0: unknown


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished or aborted) and return every block it held at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request_id)
        return request

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._with_draft(request, budget)
            if not self._allocate_or_preempt(request, n, preempted):
                break
            scheduled.append(self._entry(request, n))
            budget -= n
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            n = self._admit(request, budget)
            if n is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append(self._entry(request, n))
            budget -= n
        return StepPlan(tuple(scheduled), tuple(preempted))

    def _admit(self, request: Request, budget: int) -> int | None:
        """Blocks for a waiting request: its cached prefix, shared (num_computed_tokens moves
        past it), plus new ones for the tokens it computes now, which it returns; None, with
        nothing changed, when they do not fit."""
        cached = self.kv.find_cached(request.request_id, request.all_token_ids, request.sampling.cache_salt)
        hit = len(cached) * self.kv.block_size
        n = min(request.num_tokens - hit, budget)
        if not self.kv.allocate(request.request_id, hit + n, cached):
            return None
        self.kv.record_lookup(request.num_tokens, hit)
        request.num_computed_tokens = hit
        if request.num_cached_tokens < 0:     # reported once, as vLLM does: a recompute is ours
            request.num_cached_tokens = min(hit, request.num_prompt_tokens)
        return n

    def _with_draft(self, request: Request, budget: int) -> int:
        """Tokens to compute for a running request: its draft tree rides along with a decode
        token when the budget and free blocks allow it without preempting anybody, keeping a
        block free for every running request (else it is dropped: the round decodes plainly)."""
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        draft = request.draft
        if draft is None:
            return n
        total = request.num_computed_tokens + 1 + len(draft)
        table = self.kv.block_tables.get(request.request_id, [])
        if (n == 1 and request.num_computed_tokens > 0 and 1 + len(draft) <= budget
                and self.kv.blocks_for(total) - len(table) <= self.kv.num_free_blocks - len(self.running)):
            return 1 + len(draft)
        request.draft = None
        return n

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[str]) -> bool:
        """Grow the request's blocks, preempting the newest running requests until it fits."""
        while not self.kv.allocate(request.request_id, request.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft = None
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _entry(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        # Everything the step writes (chunk, draft tree, the accepted path keep_path moves) lies
        # in [start, start + n): never a shared or cached block.
        assert self.kv.writable(request.request_id, start, start + n), request.request_id
        draft, request.draft = request.draft, None
        tokens = tuple(request.all_token_ids[start:start + n])
        if draft is not None and n == 1 + len(draft):
            return ScheduledRequest(request.request_id, tokens[:1] + draft.tokens, start,
                                    tuple(self.kv.block_tables[request.request_id]), True, draft.parents,
                                    request.num_prompt_tokens)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            block_table=tuple(self.kv.block_tables[request.request_id]),
            sample=start + n == request.num_tokens,
            prompt_len=request.num_prompt_tokens,
        )

    def on_step_done(self, plan: StepPlan) -> None:
        """Advance num_computed_tokens of every request the plan computed. Of a draft tree only
        the decode token counts here; the engine adds the accepted path after verification."""
        for entry in plan.scheduled:
            request = self.requests.get(entry.request_id)
            if request is not None:
                self.advance(request, 1 if entry.tree_parents else len(entry.token_ids))

    def advance(self, request: Request, n: int) -> None:
        """n more of the request's tokens have their KV in place: its full blocks join the cache."""
        request.num_computed_tokens += n
        self.kv.commit(request.request_id, request.all_token_ids, request.num_computed_tokens,
                       request.sampling.cache_salt)
