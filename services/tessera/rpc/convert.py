"""Protobuf <-> Tessera dataclasses, in one place; nothing else builds or reads *_pb2 messages
except the service entrypoints and the gRPC client."""
from __future__ import annotations

import dataclasses

import grpc

from tessera.config import SamplingParams, StructuredOutput
from tessera.disagg.control import ConnectReply, ConnectRequest, ExpertInfo, LinkRefused
from tessera.draft_api import DraftInfo, DraftRound, RoundRefused
from tessera.generation_defaults import GenerationDefaults
from tessera.pipeline.control import StageInfo, StageLink, StageRefused, StageReply
from tessera.request import RequestTimings, Resume
from tessera.rpc.v1 import common_pb2, draft_pb2, expert_pb2, pipeline_pb2, worker_pb2
from tessera.spec.tree import Draft
from tessera.worker_api import (ChatMessage, ContextLengthExceeded, GenerateChunk, GenerateInput, InternalError,
                                InvalidRequest, Saturated, Tokenized, TokenizeInput, TokenLogprobInfo, ToolCall,
                                TopToken, Unavailable, WorkerError, WorkerInfo)


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids), max_tokens=sp.max_tokens or 0, min_tokens=sp.min_tokens,
        ignore_eos=sp.ignore_eos, logprobs=-1 if sp.logprobs is None else sp.logprobs,
        include_stop_str_in_output=sp.include_stop_str_in_output, logit_bias=dict(sp.logit_bias),
        cache_salt=sp.cache_salt or "")
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.structured is not None:
        msg.structured.CopyFrom(common_pb2.StructuredOutput(
            kind=sp.structured.kind, value=sp.structured.value, param=sp.structured.param))
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids), max_tokens=msg.max_tokens or None,
        min_tokens=msg.min_tokens, ignore_eos=msg.ignore_eos,
        logprobs=None if msg.logprobs < 0 else msg.logprobs,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=tuple(sorted(msg.logit_bias.items())), cache_salt=msg.cache_salt or None,
        structured=StructuredOutput(msg.structured.kind, msg.structured.value, msg.structured.param or
                                    "response_format") if msg.HasField("structured") else None)


def generate_request_to_proto(req: GenerateInput) -> worker_pb2.GenerateRequest:
    msg = worker_pb2.GenerateRequest(request_id=req.request_id, sampling=sampling_to_proto(req.sampling))
    if req.resume is not None:
        msg.resume.CopyFrom(worker_pb2.Resume(output_token_ids=list(req.resume.output_token_ids),
                                              text_sent=req.resume.text_sent))
    if req.messages is not None:
        msg.chat.CopyFrom(common_pb2.ChatPrompt(messages=[chat_message_to_proto(m) for m in req.messages],
                                                add_generation_prompt=True, tools_json=req.tools or ""))
    elif req.token_ids is not None:
        msg.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(req.token_ids)))
    else:
        msg.text = req.text or ""
    return msg


def session_generate(req: GenerateInput, log_request_id: str,
                     trace_context: dict[str, str] | None = None) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(generate=generate_request_to_proto(req), log_request_id=log_request_id,
                                     trace_context=trace_context or {})


def session_abort(request_id: str) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(abort=request_id)


def generate_request_from_proto(msg: worker_pb2.GenerateRequest) -> GenerateInput:
    kind = msg.WhichOneof("prompt")
    return GenerateInput(
        request_id=msg.request_id, sampling=sampling_from_proto(msg.sampling),
        text=msg.text if kind == "text" else None,
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        messages=tuple(chat_message_from_proto(m) for m in msg.chat.messages) if kind == "chat" else None,
        tools=(msg.chat.tools_json or None) if kind == "chat" else None,
        resume=Resume(tuple(msg.resume.output_token_ids), msg.resume.text_sent) if msg.HasField("resume") else None)


def tokenize_request_to_proto(req: TokenizeInput) -> worker_pb2.TokenizeRequest:
    msg = worker_pb2.TokenizeRequest(add_special_tokens=req.add_special_tokens,
                                     return_token_strs=req.return_token_strs)
    if req.messages is not None:
        msg.chat.CopyFrom(common_pb2.ChatPrompt(messages=[chat_message_to_proto(m) for m in req.messages],
                                                add_generation_prompt=True, tools_json=req.tools or ""))
    else:
        msg.text = req.text or ""
    return msg


def tokenize_request_from_proto(msg: worker_pb2.TokenizeRequest) -> TokenizeInput:
    if msg.WhichOneof("prompt") == "chat":
        return TokenizeInput(messages=tuple(chat_message_from_proto(m) for m in msg.chat.messages),
                             tools=msg.chat.tools_json or None, add_special_tokens=msg.add_special_tokens,
                             return_token_strs=msg.return_token_strs)
    return TokenizeInput(text=msg.text, add_special_tokens=msg.add_special_tokens,
                         return_token_strs=msg.return_token_strs)


def tokenized_to_proto(t: Tokenized) -> worker_pb2.TokenizeResponse:
    return worker_pb2.TokenizeResponse(token_ids=list(t.token_ids), tokens=list(t.tokens),
                                       max_model_len=t.max_model_len)


def tokenized_from_proto(msg: worker_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(tuple(msg.token_ids), tuple(msg.tokens), msg.max_model_len)


def chat_message_to_proto(m: ChatMessage | tuple[str, str]) -> common_pb2.ChatMessage:
    m = ChatMessage(*m)
    return common_pb2.ChatMessage(
        role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
        tool_calls=[common_pb2.ToolCall(id=c.id, type=c.type, name=c.name, arguments=c.arguments)
                    for c in m.tool_calls])


def chat_message_from_proto(m: common_pb2.ChatMessage) -> ChatMessage:
    def optional(field: str) -> str | None:
        return getattr(m, field) if m.HasField(field) else None
    return ChatMessage(m.role, optional("content"), optional("name"), optional("tool_call_id"),
                       tuple(ToolCall(c.id, c.name, c.arguments, c.type) for c in m.tool_calls))


def chunk_to_proto(c: GenerateChunk) -> worker_pb2.GenerateResponse:
    t = c.timings
    return worker_pb2.GenerateResponse(
        timings=None if t is None else worker_pb2.RequestTimings(
            queue_time_s=t.queue_time_s, prefill_time_s=t.prefill_time_s, decode_time_s=t.decode_time_s),
        text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason or "",
        usage=common_pb2.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens),
        prompt_token_ids=list(c.prompt_token_ids), accepted_prediction_tokens=c.accepted_tokens,
        rejected_prediction_tokens=c.rejected_tokens, cached_tokens=c.cached_tokens,
        logprobs=[worker_pb2.TokenLogprob(
            token_id=lp.token_id, token=lp.token, logprob=lp.logprob, token_bytes=lp.token_bytes,
            top=[worker_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob,
                                       token_bytes=t.token_bytes) for t in lp.top])
            for lp in c.logprobs])


def chunk_from_proto(msg: worker_pb2.GenerateResponse) -> GenerateChunk:
    t = msg.timings
    return GenerateChunk(
        timings=RequestTimings(t.queue_time_s, t.prefill_time_s, t.decode_time_s) if msg.HasField("timings") else None,
        text=msg.text, token_ids=tuple(msg.token_ids), finish_reason=msg.finish_reason or None,
        prompt_tokens=msg.usage.prompt_tokens, completion_tokens=msg.usage.completion_tokens,
        prompt_token_ids=tuple(msg.prompt_token_ids), accepted_tokens=msg.accepted_prediction_tokens,
        rejected_tokens=msg.rejected_prediction_tokens, cached_tokens=msg.cached_tokens,
        logprobs=tuple(TokenLogprobInfo(
            lp.token_id, lp.token, lp.logprob, lp.token_bytes,
            tuple(TopToken(t.token_id, t.token, t.logprob, t.token_bytes) for t in lp.top))
            for lp in msg.logprobs))


def update_to_proto(request_id: str, chunk: GenerateChunk | None = None,
                    error: WorkerError | None = None) -> worker_pb2.SessionUpdate:
    """A session's news for one request: its next chunk, or the error that ended it (the
    status a Generate stream would have ended with)."""
    if error is not None:
        code, details = error_to_status(error)
        return worker_pb2.SessionUpdate(request_id=request_id, error_code=code.value[0], error_details=details)
    return worker_pb2.SessionUpdate(request_id=request_id, output=chunk_to_proto(chunk))


def update_from_proto(u: worker_pb2.SessionUpdate) -> GenerateChunk | WorkerError:
    if u.error_code:
        return error_from_status(_CODES.get(u.error_code, grpc.StatusCode.UNKNOWN), u.error_details)
    return chunk_from_proto(u.output)


def info_to_proto(i: WorkerInfo) -> worker_pb2.InfoResponse:
    return worker_pb2.InfoResponse(
        model_id=i.model_id, max_model_len=i.max_model_len, num_kv_blocks=i.num_kv_blocks,
        kv_block_size=i.kv_block_size, num_free_kv_blocks=i.num_free_kv_blocks,
        num_running=i.num_running, num_waiting=i.num_waiting, dtype=i.dtype, role=i.role, compat=i.compat,
        speculative=i.speculative, spec_verify_rounds=i.spec_verify_rounds, spec_draft_tokens=i.spec_draft_tokens,
        spec_accepted_tokens=i.spec_accepted_tokens, spec_emitted_tokens=i.spec_emitted_tokens,
        prefix_cache_queries=i.prefix_cache_queries, prefix_cache_hits=i.prefix_cache_hits,
        stage_compute_s=i.stage_compute_s,
        generation_defaults=worker_pb2.GenerationDefaults(**i.generation_defaults.given()),
        tool_call_parser=i.tool_call_parser, chat_template=i.chat_template)


def info_from_proto(m: worker_pb2.InfoResponse) -> WorkerInfo:
    d = m.generation_defaults
    defaults = GenerationDefaults(**{f.name: getattr(d, f.name) for f in dataclasses.fields(GenerationDefaults)
                                     if d.HasField(f.name)})
    return WorkerInfo(m.model_id, m.max_model_len, m.num_kv_blocks, m.kv_block_size,
                      m.num_free_kv_blocks, m.num_running, m.num_waiting, m.dtype, m.role, m.compat,
                      m.speculative, m.spec_verify_rounds, m.spec_draft_tokens, m.spec_accepted_tokens,
                      m.spec_emitted_tokens, m.prefix_cache_queries, m.prefix_cache_hits, m.stage_compute_s,
                      generation_defaults=defaults, tool_call_parser=m.tool_call_parser,
                      chat_template=m.chat_template)


# WorkerError <-> gRPC status. The error class travels in the details as "<code>|<param>|<message>".
_STATUS = {InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, Saturated: grpc.StatusCode.RESOURCE_EXHAUSTED,
           Unavailable: grpc.StatusCode.UNAVAILABLE}


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def error_to_status(e: WorkerError) -> tuple[grpc.StatusCode, str]:
    status = next((s for cls, s in _STATUS.items() if isinstance(e, cls)), grpc.StatusCode.INTERNAL)
    return status, f"{e.code or ''}|{e.param or ''}|{e}"


def error_from_status(code: grpc.StatusCode, details: str | None) -> WorkerError:
    parts = (details or "").split("|", 2)
    err_code, param, message = parts if len(parts) == 3 else ("", "", details or code.name)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        cls = ContextLengthExceeded if err_code == "context_length_exceeded" else InvalidRequest
        return cls(message, param or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Saturated(message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"worker unavailable: {message}")
    if code == grpc.StatusCode.INTERNAL and err_code == InternalError.code:
        return InternalError(message)
    return WorkerError(f"worker error ({code.name}): {message}")


# The AFD control plane (expert.proto) <-> tessera.disagg.control.
def connect_request_to_proto(r: ConnectRequest) -> expert_pb2.ConnectRequest:
    return expert_pb2.ConnectRequest(attention_node=r.attention_node, transport=r.transport,
                                     transport_metadata=r.transport_metadata, model_id=r.model_id,
                                     num_layers=r.num_layers)


def connect_request_from_proto(m: expert_pb2.ConnectRequest) -> ConnectRequest:
    return ConnectRequest(m.attention_node, m.transport, m.transport_metadata, m.model_id, m.num_layers)


def connect_reply_to_proto(r: ConnectReply) -> expert_pb2.ConnectResponse:
    return expert_pb2.ConnectResponse(expert_node=r.expert_node, transport_metadata=r.transport_metadata,
                                      shard_index=r.shard_index, shard_count=r.shard_count, experts=r.experts)


def connect_reply_from_proto(m: expert_pb2.ConnectResponse) -> ConnectReply:
    return ConnectReply(m.expert_node, m.transport_metadata, m.shard_index, m.shard_count, tuple(m.experts))


def expert_info_to_proto(i: ExpertInfo) -> expert_pb2.ExpertInfoResponse:
    return expert_pb2.ExpertInfoResponse(
        expert_node=i.expert_node, model_id=i.model_id, shard_index=i.shard_index, shard_count=i.shard_count,
        transport=i.transport, tokens_in=i.tokens_in, rejected=i.rejected, attention_nodes=list(i.attention_nodes),
        compute_s=i.compute_s, batches=i.batches, uptime_s=i.uptime_s, experts=i.experts)


def expert_info_from_proto(m: expert_pb2.ExpertInfoResponse) -> ExpertInfo:
    return ExpertInfo(m.expert_node, m.model_id, m.shard_index, m.shard_count, m.transport, m.tokens_in,
                      m.rejected, tuple(m.attention_nodes), m.compute_s, m.batches, m.uptime_s, tuple(m.experts))


def link_error_from_status(code: grpc.StatusCode, details: str | None) -> Exception:
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LinkRefused(details or "link refused")
    return Unavailable(f"expert node unavailable: {details or code.name}")


# The draft worker (draft.proto) <-> tessera.draft_api and spec.tree.Draft.
def round_to_proto(r: DraftRound) -> draft_pb2.RoundRequest:
    return draft_pb2.RoundRequest(request_id=r.request_id, round=r.round, token_ids=list(r.token_ids),
                                  num_tokens=r.num_tokens, size=r.size)


def round_from_proto(m: draft_pb2.RoundRequest) -> DraftRound:
    return DraftRound(m.request_id, m.round, tuple(m.token_ids), m.num_tokens, m.size)


def draft_to_proto(round_: int, d: Draft) -> draft_pb2.RoundReply:
    return draft_pb2.RoundReply(round=round_, tokens=list(d.tokens), parents=list(d.parents))


def draft_from_proto(m: draft_pb2.RoundReply) -> tuple[int, Draft]:
    """(the round it answers, the subtree); ValueError when the tree is not well formed."""
    return m.round, Draft(tuple(m.tokens), tuple(m.parents))


def draft_info_to_proto(i: DraftInfo) -> draft_pb2.DraftInfoReply:
    return draft_pb2.DraftInfoReply(model_id=i.model_id, role=i.role, layers=i.layers, vocab_size=i.vocab_size,
                                    max_len=i.max_len, requests=i.requests, rounds=i.rounds, refused=i.refused)


def draft_info_from_proto(m: draft_pb2.DraftInfoReply) -> DraftInfo:
    return DraftInfo(m.model_id, m.layers, m.vocab_size, m.max_len, m.requests, m.rounds, m.refused, m.role)


def refusal_to_status(e: RoundRefused) -> tuple[grpc.StatusCode, str]:
    return (grpc.StatusCode.FAILED_PRECONDITION if e.out_of_sync else grpc.StatusCode.INVALID_ARGUMENT), str(e)


# The pipeline control plane (pipeline.proto) <-> tessera.pipeline.control.
def stage_link_to_proto(k: StageLink) -> pipeline_pb2.StageConnectRequest:
    return pipeline_pb2.StageConnectRequest(
        pipeline=k.pipeline, transport=k.transport, model_id=k.model_id, num_layers=k.num_layers,
        stage_index=k.stage_index, stage_count=k.stage_count, layer_start=k.layers[0], layer_end=k.layers[1],
        bits=k.bits, dtype=k.dtype, num_blocks=k.num_blocks, block_size=k.block_size, upstream=k.upstream,
        downstream=k.downstream, peer_metadata=k.peer_metadata)


def stage_link_from_proto(m: pipeline_pb2.StageConnectRequest) -> StageLink:
    return StageLink(m.pipeline, m.transport, m.model_id, m.num_layers, m.stage_index, m.stage_count,
                     (m.layer_start, m.layer_end), tuple(m.bits), m.dtype, m.num_blocks, m.block_size, m.upstream,
                     m.downstream, dict(m.peer_metadata))


def stage_reply_to_proto(r: StageReply) -> pipeline_pb2.StageConnectResponse:
    return pipeline_pb2.StageConnectResponse(stage=r.stage, metadata=r.metadata)


def stage_reply_from_proto(m: pipeline_pb2.StageConnectResponse) -> StageReply:
    return StageReply(m.stage, dict(m.metadata))


def stage_info_to_proto(i: StageInfo) -> pipeline_pb2.StageInfoResponse:
    return pipeline_pb2.StageInfoResponse(
        stage=i.stage, model_id=i.model_id, stage_index=i.stage_index, layer_start=i.layers[0],
        layer_end=i.layers[1], bits=i.bits, dtype=i.dtype, transport=i.transport, num_blocks=i.num_blocks,
        block_size=i.block_size, weight_bytes=i.weight_bytes, kv_bytes=i.kv_bytes,
        memory_budget_bytes=i.memory_budget_bytes, pipeline=i.pipeline, micro_batches=i.micro_batches,
        tokens=i.tokens, rejected=i.rejected, compute_s=i.compute_s, uptime_s=i.uptime_s)


def stage_info_from_proto(m: pipeline_pb2.StageInfoResponse) -> StageInfo:
    return StageInfo(m.stage, m.model_id, m.stage_index, (m.layer_start, m.layer_end), tuple(m.bits), m.dtype,
                     m.transport, m.num_blocks, m.block_size, m.weight_bytes, m.kv_bytes, m.memory_budget_bytes,
                     m.pipeline, m.micro_batches, m.tokens, m.rejected, m.compute_s, m.uptime_s)


def stage_error_from_status(code: grpc.StatusCode, details: str | None) -> Exception:
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return StageRefused(details or "stage refused the link")
    return Unavailable(f"pipeline stage unavailable: {details or code.name}")
