"""The worker boundary as plain dataclasses: what the gateway sends and gets back.

Two implementations share this interface (WorkerClient): LocalWorkerClient runs an
AsyncEngine in-process (the twin used in tests), GrpcWorkerClient (rpc/client.py) talks to a
worker process. rpc/convert.py maps these to and from protobuf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, NamedTuple, Protocol

from tessera.config import SamplingParams
from tessera.generation_defaults import GenerationDefaults
from tessera.request import RequestTimings, Resume


class ToolCall(NamedTuple):
    """A function call an assistant message made (OpenAI's tool_calls entry)."""
    id: str
    name: str
    arguments: str          # JSON text, as the client sent it
    type: str = "function"


class ChatMessage(NamedTuple):
    """One chat message; a plain (role, content) pair is one too (ChatMessage(*pair))."""
    role: str
    content: str | None     # text parts already joined; None: null
    name: str | None = None
    tool_call_id: str | None = None          # role "tool"
    tool_calls: tuple[ToolCall, ...] = ()    # role "assistant"


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    sampling: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # apply the chat template
    resume: Resume | None = None      # failover: continue a generation another worker began
    tools: str | None = None          # with messages: function definitions for the template, a JSON list


@dataclass(frozen=True)
class TopToken:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprobInfo:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class GenerateChunk:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobInfo, ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_token_ids: tuple[int, ...] = ()
    accepted_tokens: int = 0          # speculative decoding: draft tokens accepted so far (this request)
    rejected_tokens: int = 0          # and verified but rejected so far
    cached_tokens: int = 0            # prompt tokens the worker's prefix cache served
    timings: RequestTimings | None = None   # the last chunk: queue / prefill / decode in the worker


@dataclass(frozen=True)
class TokenizeInput:
    """vLLM's /tokenize: a text, or chat messages (and tools) rendered as a chat request's prompt."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: str | None = None          # with messages: a JSON list, as GenerateInput.tools
    add_special_tokens: bool = True   # text only: the tokenizer's BOS and the like
    return_token_strs: bool = False


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]           # each id's vocabulary piece ("Ġthe"), as vLLM's token_strs; () unless asked
    max_model_len: int


@dataclass(frozen=True)
class WorkerInfo:
    model_id: str
    max_model_len: int
    num_kv_blocks: int
    kv_block_size: int
    num_free_kv_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    dtype: str = ""
    role: str = "worker"
    compat: str = ""      # compatibility hash: a stream fails over only between equal hashes
    speculative: str = ""            # who drafts ("" none, "self:2", "self:2 @ host:port")
    spec_verify_rounds: int = 0      # since start (engine.SpecStats): draft trees verified,
    spec_draft_tokens: int = 0       # their draft tokens,
    spec_accepted_tokens: int = 0    # those the target accepted,
    spec_emitted_tokens: int = 0     # and tokens the rounds emitted (acceptance length = emitted / rounds)
    prefix_cache_queries: int = 0    # since start, in tokens: looked up in the prefix cache at admission,
    prefix_cache_hits: int = 0       # and found there
    stage_compute_s: float = 0.0     # a pipeline's first stage: seconds in its own layers since start
    replay_checks: int = 0           # replayed steps checked again against the eager step (replay_check_every),
    replay_mismatches: int = 0       # and those that differed (their graph dropped)
    generation_defaults: GenerationDefaults = GenerationDefaults()   # for fields a request leaves unset
    tool_call_parser: str = ""       # --tool-call-parser ("": none, so tool_choice "auto" is refused)
    chat_template: str = ""          # --chat-template's file name; "": the tokenizer's own


class WorkerError(Exception):
    """Base of errors a worker reports; `status` is the HTTP status the gateway answers with."""

    status = 500
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(WorkerError):
    status = 400


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Saturated(WorkerError):
    """The worker's queue is full: try again later (HTTP 503 with Retry-After)."""

    status = 503


class Unavailable(WorkerError):
    """The worker cannot be reached or failed mid-request (the gateway may fail over)."""

    status = 503


class Misconfigured(WorkerError):
    """The worker refuses this gateway for a reason no retry on it fixes (the gateway's role may
    not call it, an RPC it lacks, credentials it does not take: its deployment's configuration):
    the pool takes it out of rotation and goes on on another replica; with none left, HTTP 503
    with Retry-After. grpc_status: the status it answered (e.g. "UNAUTHENTICATED")."""

    status = 503

    def __init__(self, message: str, grpc_status: str = "") -> None:
        super().__init__(message)
        self.grpc_status = grpc_status


class InternalError(WorkerError):
    """The worker is up but failed this request (a bug): 500, and never replayed elsewhere."""

    status = 500
    code = "internal_error"


class WorkerClient(Protocol):
    """What the gateway calls; GrpcWorkerClient, its in-process twin LocalWorkerClient and
    WorkerPool all satisfy it (tests/test_interfaces.py type-checks that with mypy)."""

    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """The worker's model and load; WorkerError (Unavailable) when it does not answer in timeout_s."""
        ...

    async def tokenize(self, request: TokenizeInput, timeout_s: float = 30.0) -> Tokenized:
        """The model's token ids for a text or chat messages; InvalidRequest for what it cannot render."""
        ...

    async def detokenize(self, token_ids: tuple[int, ...], timeout_s: float = 30.0) -> str:
        """The ids' text; InvalidRequest for an id outside the vocabulary."""
        ...

    async def close(self) -> None: ...


