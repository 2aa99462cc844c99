"""Tessera's SamplingParams as vLLM's, and the limits a request is checked against first.

Every sampling field the gateway passes has a vLLM twin with the same meaning (Tessera took
vLLM's extensions and its order: raw-logit logprobs -> penalties -> logit_bias -> min_tokens
-> temperature / top-k / top-p / min-p), so the mapping is one to one. Stop strings are not
passed: the adapter detokenizes with Tessera's IncrementalDetokenizer, which also resumes a
stream another worker began. What vLLM refuses (token ids outside the vocabulary in the prompt,
logit_bias or stop_token_ids) comes back as its VLLMValidationError, a 400 naming the field
(as_worker_error). What it cannot honour on a resumed stream is said in to_vllm.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from tessera.config import SamplingParams
from tessera.seeds import draw_seed
from tessera.worker_api import (ContextLengthExceeded, InternalError, InvalidRequest, Saturated, Unavailable,
                                WorkerError)

_TINY_TOP_P = 1e-6


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    kv_tokens: int          # what vLLM's KV cache holds (blocks x block size)


def resolve(sampling: SamplingParams, prompt_len: int, done: int, limits: Limits,
            prompt_param: str) -> SamplingParams:
    """The native engine's rule (Engine.resolve): max_tokens None means as much as both the
    context and the KV cache hold; prompt + max_tokens beyond either is context_length_exceeded.
    `done` output tokens came from another worker (a resumed stream) and count as output."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty", prompt_param)
    room = min(limits.max_model_len, limits.kv_tokens) - prompt_len - done
    if sampling.max_tokens is None:
        if room < 1:
            raise ContextLengthExceeded(_too_long(limits, prompt_len + done, 1), prompt_param)
        return replace(sampling, max_tokens=done + room, min_tokens=min(sampling.min_tokens, done + room))
    total = prompt_len + sampling.max_tokens
    if total > limits.max_model_len:
        raise ContextLengthExceeded(_too_long(limits, prompt_len, sampling.max_tokens), prompt_param)
    if total > limits.kv_tokens:
        raise ContextLengthExceeded(f"{total} tokens do not fit in the KV cache of this worker "
                                    f"({limits.kv_tokens} tokens)", prompt_param)
    return sampling


def _too_long(limits: Limits, num_tokens: int, max_tokens: int) -> str:
    return (f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {num_tokens + max_tokens} tokens ({num_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")


def to_vllm(s: SamplingParams, done: int = 0):
    """vllm.SamplingParams for the tokens still to come (`done` already generated elsewhere;
    s.max_tokens resolved). Streaming deltas of token ids; no detokenization in vLLM.

    A resumed stream cannot be continued exactly as it would have gone on: vLLM sees the earlier
    output as prompt (presence / frequency penalties no longer count it) and its seeded generator
    cannot jump to position `done`, so a seeded request continues from draw_seed(seed, done):
    reproducible, but not the draws the first worker would have made (the native engine's are)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind
    seed = s.seed if s.seed is None or not done else draw_seed(s.seed, done)
    # Tessera's greedy is any temperature below SAMPLING_EPS; vLLM would raise one in (0, 0.01)
    # to 0.01 and sample. top_p 0 (OpenAI's range) keeps the most likely token; vLLM wants > 0.
    return VllmSamplingParams(
        temperature=0.0 if s.greedy else s.temperature, top_p=max(s.top_p, _TINY_TOP_P), top_k=s.top_k,
        min_p=s.min_p, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, seed=seed, stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, max_tokens=s.max_tokens - done, min_tokens=max(0, s.min_tokens - done),
        logprobs=s.logprobs, logit_bias=dict(s.logit_bias) or None,
        output_kind=RequestOutputKind.DELTA, detokenize=False, **_structured(s, done))


def _structured(s: SamplingParams, done: int) -> dict:
    """The structured output as vLLM's StructuredOutputsParams (its grammar backend compiles it;
    Lark grammars need its guidance backend). A resumed constrained stream is refused: vLLM
    would start the grammar over at the tokens the first worker generated."""
    if s.structured is None:
        return {}
    if done:
        raise InvalidRequest("a structured output cannot be resumed on the vLLM engine", s.structured.param)
    from vllm.sampling_params import StructuredOutputsParams
    kind, value = s.structured.kind, s.structured.value
    args = {"json": {"json": value}, "json_object": {"json_object": True}, "regex": {"regex": value},
            "choice": {"choice": json.loads(value) if value else []}, "grammar": {"grammar": value}}[kind]
    return {"structured_outputs": StructuredOutputsParams(**args)}


def vllm_prompt(token_ids: list[int], s: SamplingParams):
    """vLLM's TokensPrompt, with the request's cache_salt (vLLM mixes it into the prefix cache's
    first block hash, as Tessera's KV cache does)."""
    from vllm.inputs import TokensPrompt
    salt = {"cache_salt": s.cache_salt} if s.cache_salt else {}
    return TokensPrompt(prompt_token_ids=token_ids, **salt)


def as_worker_error(e: Exception) -> WorkerError:
    """A vLLM exception as the error the client sees: validation -> 400 with the field, back-
    pressure -> 503 Saturated, a dead engine -> Unavailable (the gateway fails over), anything
    else -> 500 (never replayed elsewhere)."""
    from vllm.exceptions import GracefulHTTPError, VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError
    if isinstance(e, VLLMValidationError):
        return InvalidRequest(f"vLLM refused the request: {e.args[0] if e.args else e}", e.parameter)
    if isinstance(e, GracefulHTTPError):
        return Saturated(f"vLLM is saturated: {e}")
    if isinstance(e, EngineDeadError):
        return Unavailable(f"the vLLM engine died: {e}")
    return InternalError(f"the vLLM engine failed this request: {type(e).__name__}: {e}")
