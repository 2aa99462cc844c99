"""OpenAI request -> Tessera SamplingParams and GenerateInputs (one per prompt x n)."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from tessera.config import INT32_MAX, ConfigError, SamplingParams, StructuredOutput
from tessera.generation_defaults import GenerationDefaults
from tessera.openai_api.chat_messages import worker_messages, worker_tools
from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tessera.openai_api.structured import structured_output
from tessera.openai_api.tools import ToolPlan, constraint, tool_plan
from tessera.seeds import choice_seed
from tessera.worker_api import GenerateInput

_TOKEN_ID = re.compile(r"[0-9]{1,10}")     # ASCII digits only: int() also takes "١٢", "1_0"


@dataclass(frozen=True)
class RequestRules:
    """What the gateway allows one request (admission.py builds it from its config and the
    caller's key): caps on lists a body of max_body_bytes could otherwise fill with hundreds of
    thousands of entries, each costing engine time on every step; and the tenant whose own
    prefix-cache namespace the request uses (None: the caller's cache_salt, or none, as sent)."""

    max_messages: int = 2048
    max_logit_bias: int = 300          # OpenAI's cap
    max_stop_token_ids: int = 1024
    tenant: str | None = None


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt the worker gets: with a tenant, a digest of (tenant, the caller's salt), so a
    caller can neither share blocks with another tenant nor learn the tenant from the salt."""
    if tenant is None:
        return salt
    return hashlib.sha256(f"tessera-cache-salt\0{tenant}\0{salt or ''}".encode()).hexdigest()


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int | None, seed: int | None, rules: RequestRules = RequestRules(),
                    defaults: GenerationDefaults = GenerationDefaults(),
                    forced: StructuredOutput | None = None) -> SamplingParams:
    """A field the request leaves unset (None) takes the model's default (generation_config.json,
    as vLLM), else SamplingParams' own; max_tokens None (chat without a limit) likewise.
    forced: the constraint of forced tool calls (tools.constraint), in place of response_format's."""
    _check_caps(req, rules)
    try:
        return SamplingParams(
            temperature=float(_first(req.temperature, defaults.temperature, 1.0)),
            top_p=float(_first(req.top_p, defaults.top_p, 1.0)),
            top_k=0 if req.top_k == -1 else _first(req.top_k, defaults.top_k, 0),
            min_p=float(_first(req.min_p, defaults.min_p, 0.0)),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            repetition_penalty=float(_first(req.repetition_penalty, defaults.repetition_penalty, 1.0)),
            seed=seed, stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
            max_tokens=_first(max_tokens, defaults.max_tokens, None), min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=_logit_bias(req.logit_bias), cache_salt=cache_salt(rules.tenant, req.cache_salt),
            structured=forced or structured_output(req))
    except ConfigError as e:
        raise APIError(400, str(e), param=e.param) from e


def _first(given, default, neutral):
    return given if given is not None else default if default is not None else neutral


def _check_caps(req: ChatCompletionRequest | CompletionRequest, rules: RequestRules) -> None:
    for name, items, cap in (("logit_bias", req.logit_bias, rules.max_logit_bias),
                             ("stop_token_ids", req.stop_token_ids, rules.max_stop_token_ids)):
        if items is not None and len(items) > cap:
            raise APIError(400, f"{name} has {len(items)} entries; at most {cap} are allowed", name)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map as sorted (id, bias) pairs; ranges are SamplingParams'."""
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key.strip()):
            raise ConfigError(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def chat_inputs(req: ChatCompletionRequest, request_id: str, rules: RequestRules = RequestRules(),
                defaults: GenerationDefaults = GenerationDefaults(),
                tools: ToolPlan | None = None) -> list[GenerateInput]:
    """tools: the request's tool plan (tools.tool_plan), whose forced calls constrain decoding;
    None: planned here as for a worker without a tool-call parser."""
    if len(req.messages) > rules.max_messages:
        raise APIError(400, f"{len(req.messages)} messages; at most {rules.max_messages} are allowed", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    forced = constraint(req, tools if tools is not None else tool_plan(req, ""))
    messages, tool_list = worker_messages(req.messages), worker_tools(req)
    return [GenerateInput(f"{request_id}-{j}", _params(req, max_tokens, logprobs, j, rules, defaults, forced),
                          messages=messages, tools=tool_list) for j in range(req.n)]


def completion_inputs(req: CompletionRequest, request_id: str, max_choices: int,
                      rules: RequestRules = RequestRules(),
                      defaults: GenerationDefaults = GenerationDefaults()) -> list[GenerateInput]:
    """One input per prompt and choice; more than max_choices of them is refused (each is a
    whole generation, counted as such by admission)."""
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (beam search is not supported)", "best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", "echo")
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > max_choices:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is more than the {max_choices} "
                       "generations one request may ask for", "prompt" if len(prompts) > 1 else "n")
    inputs = []
    for i, prompt in enumerate(prompts):
        for j in range(req.n):
            params = _params(req, req.max_tokens, req.logprobs, j, rules, defaults)
            rid = f"{request_id}-{i * req.n + j}"
            if isinstance(prompt, str):
                inputs.append(GenerateInput(rid, params, text=prompt))
            else:
                inputs.append(GenerateInput(rid, params, token_ids=tuple(prompt)))
    return inputs


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return _prompts([prompt])
    if any(isinstance(p, list) and not p for p in prompt):
        raise APIError(400, "prompt token lists must not be empty", "prompt")
    if any(isinstance(p, list) and any(not 0 <= t <= INT32_MAX for t in p) for p in prompt):
        raise APIError(400, "prompt token ids must be integers in [0, 2^31)", "prompt")
    return list(prompt)


def _params(req, max_tokens: int | None, logprobs: int | None, j: int, rules: RequestRules,
            defaults: GenerationDefaults, forced: StructuredOutput | None = None) -> SamplingParams:
    """max_tokens None means up to the context (the worker subtracts the prompt length);
    choice j of n draws from its own seed (seeds.choice_seed) so seeded choices differ."""
    if req.seed is not None and not -2**63 <= req.seed < 2**63:
        raise APIError(400, "seed must fit in 64 bits", "seed")
    seed = None if req.seed is None else choice_seed(req.seed, j)
    return sampling_params(req, max_tokens, logprobs, seed, rules, defaults, forced)
