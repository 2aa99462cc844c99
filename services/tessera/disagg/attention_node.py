"""Build an attention node's engine: the model without its FFN weights, a transport endpoint
linked to every expert node over the control plane, and an AttentionRunner."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from tessera.config import AfdConfig, EngineConfig
from tessera.disagg.attention_runner import AttentionRunner
from tessera.disagg.control import ConnectReply, ConnectRequest, ExpertControl, LinkRefused
from tessera.disagg.expert_shard import expert_owners
from tessera.engine import Engine, resolve_dtype
from tessera.models.llama import CausalLM
from tessera.models.loader import load_model, model_id_for
from tessera.transport import make_transport, resolve_backend
from tessera.worker_api import Unavailable

log = logging.getLogger("tessera.disagg.attention")


def drop_ffn_weights(model: CausalLM) -> None:
    """The attention side keeps each FFN's norm, router and shared expert; the expert nodes
    hold the rest. Called before loading, so those weights are never read here."""
    model.drop_ffn_compute()


def build_attention_engine(config: EngineConfig, afd: AfdConfig, controls: list[ExpertControl],
                           transport=None) -> Engine:
    model, _ = load_model(config.model, resolve_dtype(config.dtype), prune=drop_ffn_weights)
    backend = resolve_backend(afd.transport) if transport is None else "local"
    if transport is None:
        cfg = model.config   # a reply is at most one chunk of hidden states
        reply_bytes = config.scheduler.max_num_batched_tokens * cfg.hidden_size * 4
        transport = make_transport(backend, afd.name, slots=max(2, afd.micro_batches), timeout_s=afd.timeout_s,
                                   capacity_bytes=max(8 << 20, reply_bytes), advertise=afd.transport_advertise)
    request = ConnectRequest(afd.name, backend, b"", model_id_for(config.model), model.config.num_layers)
    replies = [_link(c, request, transport, i, len(controls), afd.connect_wait_s) for i, c in enumerate(controls)]
    names = [r.expert_node for r in replies]
    placement = [r.experts for r in replies] if model.config.num_experts else None
    if placement is not None:
        try:
            expert_owners(placement, model.config.num_experts)
        except ValueError as e:
            raise LinkRefused(f"expert placement: {e}") from None
    by_name = dict(zip(names, controls))

    def reconnect(node: str) -> None:
        j = names.index(node)
        reply = _link(by_name[node], request, transport, j, len(names), wait_s=0)
        if placement is not None and reply.experts != placement[j]:   # a restart with another set
            raise LinkRefused(f"expert node {node} came back holding experts {list(reply.experts)}, "
                              f"not {list(placement[j])}")

    def make_runner(m, num_blocks, block_size):
        return AttentionRunner(m, num_blocks, block_size, transport, names, afd.micro_batches,
                               afd.timeout_s, reconnect, placement)
    return Engine(config, model, make_runner=make_runner)


def _link(control: ExpertControl, request: ConnectRequest, transport, index: int, count: int,
          wait_s: float) -> ConnectReply:
    """Connect to one expert node (waiting while it starts) and link the transports."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = control.info()
            break
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    reply = control.connect(replace(request, transport_metadata=transport.metadata_for(info.expert_node)))
    if (reply.shard_index, reply.shard_count) != (index, count):
        raise LinkRefused(f"expert node {reply.expert_node} holds shard {reply.shard_index}/"
                          f"{reply.shard_count}, expected {index}/{count}")
    transport.connect(reply.expert_node, reply.transport_metadata)
    log.info("linked to expert node %s (shard %d/%d, experts %s)", reply.expert_node, index, count,
             list(reply.experts) or "-")
    return reply
