"""The Request: what the scheduler owns for each generation (plain Python, no torch).

Data flow: Request (here, owned by the scheduler) -> StepPlan (scheduler.py, plain data)
-> ForwardBatch (batch.py, tensors). Every request has num_computed_tokens and num_tokens;
prefill, chunked prefill, decode and recompute after preemption are all just these numbers.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tessera.config import SamplingParams
from tessera.spec.tree import Draft


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class Resume:
    """What a request carries to another replica when its worker failed mid-stream: the
    output tokens already generated, and how many characters of their text the client has
    already received (the rest, held back by the detokenizer, is still to come)."""

    output_token_ids: tuple[int, ...] = ()
    text_sent: int = 0


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time went inside the worker that finished it, in seconds
    (vLLM's request queue / prefill / decode times): tokenized -> first scheduled -> first
    token -> finished. The client's TTFT minus queue + prefill is the served path around the
    engine (HTTP, gateway, gRPC, tokenizer). A resumed request counts from its arrival at this
    worker."""

    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = -1         # prompt tokens the prefix cache served at first admission (-1: not yet)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    draft: Draft | None = None          # a draft tree to verify with the next decode token
    spec_synced: int = 0                # tokens the proposer has seen (0: it knows nothing)
    accepted_tokens: int = 0            # draft tokens accepted / verified and rejected so far
    rejected_tokens: int = 0
    scheduled_time: float | None = None     # first moved to RUNNING (a preemption keeps it)
    first_token_time: float | None = None   # this worker's first output token
    grammar: object | None = None       # its structured output's matcher (llguidance), fed every token

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        # A resumed request (failover) arrives with output already generated elsewhere: it is
        # prefilled like a preempted one, and counts as output for penalties and limits.
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def timings(self, now: float) -> RequestTimings:
        scheduled = self.scheduled_time if self.scheduled_time is not None else now
        first = self.first_token_time if self.first_token_time is not None else now
        return RequestTimings(scheduled - self.arrival_time, first - scheduled, now - first)

    def check_stop_token(self) -> RequestStatus | None:
        """Finish by length or by a stop/EOS token; stop strings are the detokenizer's job."""
        sp = self.sampling
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
