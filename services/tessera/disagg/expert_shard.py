"""An expert node's share of the model's FFNs, and the loop that serves attention nodes.

A shard holds, per layer, the FFN module cut down to its compute share (ffn.drop_ends and
ffn.shard): for an MoE layer a set of experts (a contiguous range by default, any set with
--experts; the attention node learns each node's set when it connects); for a dense layer
columns [i0, i1) of the MLP's intermediate dimension, and the attention side adds the partial
sums. A shard keeps no state between steps.

Wire format of one FFN message (attention -> expert): an FFNInput. Routed layers send float32
[n, H + 2k]: the normalized hidden states, then the token's k expert ids (small integers,
exact in float32), then its k gate weights; dense layers send [n, H] as they are. The reply is
the partial FFN output [n, H], or an error (the header's ERROR flag, transport/base.py).
A step's control message is float32 [m], or int64 [m, the step's trace context] when the
attention node traces it (tracing_detail.py); the expert node's spans of that step then join the
attention node's `afd.step`: `afd.expert_step`, and per layer and micro-batch `afd.expert` (the
compute) and `m2n.send` (the reply).
"""
from __future__ import annotations

import copy
import logging
import threading
import time

import torch
from torch import nn

from tessera import tracing_detail
from tessera.models.llama import CausalLM, FFNInput
from tessera.models.model_config import ModelConfig
from tessera.transport.base import COMBINE, DISPATCH, Tag, Transport, TransportError, send_error

log = logging.getLogger("tessera.disagg.expert")
CONTROL_LAYER = -1   # per step, each attention node first sends [m] (micro-batches); m < 0 stops


def control_message(m: int, context: tuple[int, ...] | None = None) -> torch.Tensor:
    """A step's control message: m micro-batches follow (m < 0: stop), and the step's trace
    context (tracing_detail.words) when it is traced."""
    if context is None:
        return torch.tensor([float(m)])
    return torch.tensor([m, *context], dtype=torch.int64)


def read_control(tag: Tag, control: torch.Tensor, src: str) -> tuple[int, tuple[int, ...] | None]:
    """(m, the trace context or None) of a control message; anything else raises TransportError."""
    n = control.numel()
    traced = n == 1 + tracing_detail.WORDS and control.dtype == torch.int64
    if tag.layer != CONTROL_LAYER or not (n == 1 or traced):
        raise TransportError(f"{tag} from {src} is not a step's control message")
    values = control.tolist()
    return int(values[0]), tuple(values[1:]) if traced else None


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The index-th of `parts` contiguous ranges covering [0, total)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def parse_experts(spec: str) -> tuple[int, ...]:
    """An expert set as written on the command line: "0-3,6" -> (0, 1, 2, 3, 6)."""
    ids: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"expert set {spec!r}: write ids and ranges like 0-3,6")
        ids.extend(range(int(first), int(last or first) + 1))
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"expert set {spec!r} is empty or names an expert twice")
    return tuple(ids)


def expert_set(cfg: ModelConfig, index: int, count: int, experts: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The MoE experts shard `index` of `count` holds: `experts` when given, else a contiguous
    range; () for a dense model (its shards are column slices)."""
    if not cfg.num_experts:
        if experts:
            raise ValueError("--experts applies to MoE models; a dense model is split by shard index")
        return ()
    experts = tuple(experts) if experts else tuple(range(*split_range(cfg.num_experts, count, index)))
    if not all(0 <= e < cfg.num_experts for e in experts):
        raise ValueError(f"expert set {list(experts)} is outside the model's {cfg.num_experts} experts")
    return experts


def keep_ffn_share(model: CausalLM, experts: tuple[int, ...]) -> None:
    """Prune a model before loading to what an expert node holds (the prune= of load_model):
    every layer's FFN compute, of MoE layers only `experts`; the checkpoint's other tensors are
    never read. Dense layers stay whole until ExpertShard.from_model cuts their columns (the
    checkpoint holds whole matrices)."""
    model.keep_ffn_compute(experts)


def encode(ffn_in: FFNInput) -> torch.Tensor:
    """An FFN input as one message (see the module docstring)."""
    if ffn_in.ids is None:
        return ffn_in.x
    return torch.cat([ffn_in.x.float(), ffn_in.ids.float(), ffn_in.weights.float()], dim=-1)


def decode(message: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype) -> FFNInput:
    """The FFN input a message carries, for a layer routing each token to top_k experts (0:
    dense); a message of another shape raises TransportError."""
    if message.dim() != 2 or message.shape[1] != hidden + 2 * top_k:
        raise TransportError(f"message of shape {tuple(message.shape)}, expected [n, {hidden + 2 * top_k}]")
    x = message[:, :hidden].to(dtype)
    if not top_k:
        return FFNInput(x)
    return FFNInput(x, message[:, hidden:hidden + top_k].long(), message[:, hidden + top_k:].to(dtype))


def expert_owners(placement: list[tuple[int, ...]], num_experts: int) -> torch.Tensor:
    """owner[e] = index of the node that holds expert e. Every expert must have exactly one
    owner: a token routed to nobody would silently lose its FFN output."""
    owner = torch.full((num_experts,), -1, dtype=torch.long)
    for node, ids in enumerate(placement):
        for e in ids:
            if not 0 <= e < num_experts:
                raise ValueError(f"expert node {node} holds expert {e}, but the model has {num_experts}")
            if owner[e] >= 0:
                raise ValueError(f"expert {e} is held by expert nodes {int(owner[e])} and {node}")
            owner[e] = node
    missing = (owner < 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"no expert node holds experts {missing}")
    return owner


def compute_share(ffn: nn.Module, experts: tuple[int, ...] | None, columns: tuple[int, int]) -> nn.Module:
    """A copy of `ffn` holding only its compute share; the original stays whole (in one process
    the attention side uses it). The copy shares the weight tensors until shard() cuts them."""
    held = {id(t): t for t in [*ffn.parameters(), *ffn.buffers()]}
    part = copy.deepcopy(ffn, held)
    part.drop_ends()
    part.shard(experts=experts, columns=columns)
    return part


class ExpertShard:
    def __init__(self, layers: list[nn.Module], hidden: int, dtype: torch.dtype,
                 experts: tuple[int, ...] = ()) -> None:
        """layers[l]: layer l's FFN module holding this shard's compute share."""
        self.layers, self.hidden, self.dtype = layers, hidden, dtype
        self.experts = experts   # the MoE experts held (empty for a dense model)

    @classmethod
    def from_model(cls, model: CausalLM, index: int, count: int,
                   experts: tuple[int, ...] | None = None) -> "ExpertShard":
        """Shard `index` of `count` of a model (whole, or pruned by keep_ffn_share);
        `experts` overrides which experts an MoE shard holds."""
        cfg = model.config
        experts = expert_set(cfg, index, count, experts)
        columns = split_range(cfg.intermediate_size, count, index)
        layers = [compute_share(layer.ffn, experts or None, columns) for layer in model.layers]
        dtype = next(iter(layers[0].parameters())).dtype
        return cls(layers, cfg.hidden_size, dtype, experts)

    @torch.inference_mode()
    def compute(self, layer: int, message: torch.Tensor) -> torch.Tensor:
        if not 0 <= layer < len(self.layers):
            raise TransportError(f"no layer {layer}")
        ffn = self.layers[layer]
        try:
            ffn_in = decode(message, self.hidden, ffn.top_k, self.dtype)
        except TransportError as e:
            raise TransportError(f"layer {layer}: {e}") from None
        return ffn.compute(ffn_in)


class ExpertWorker:
    """Serves one shard to attention nodes: a thread per attention node, in step order.

    Each step starts with a control message (layer CONTROL_LAYER) whose tag carries the step
    number and whose value is m; the thread then answers m micro-batches per layer. A
    malformed or stale message is rejected: the slots held from that sender are dropped, an
    error (transport send_error) goes back under the tag that was expected, and the thread
    waits for the next control message. add_source() on a known sender resets its link
    (an attention node that reconnects after an error starts clean)."""

    def __init__(self, shard: ExpertShard, transport: Transport, attention_nodes=(),
                 timeout_s: float = 60.0) -> None:
        self.shard, self.transport, self.timeout_s = shard, transport, timeout_s
        self.tokens_in = 0
        self.rejected = 0
        self.compute_s = 0.0     # for profiling: T_e and the idle fraction
        self.batches = 0
        self._threads: dict[str, threading.Thread] = {}
        self._generation: dict[str, int] = {}
        self._stopped = False
        for src in attention_nodes:
            self.add_source(src)

    def add_source(self, src: str) -> None:
        self._generation[src] = self._generation.get(src, 0) + 1
        thread = self._threads.get(src)
        if thread is not None and thread.is_alive():
            self.transport.reset(src)
            return
        thread = threading.Thread(target=self._serve, args=(src,), name=f"expert-{src}", daemon=True)
        self._threads[src] = thread
        thread.start()

    def _serve(self, src: str) -> None:
        while not self._stopped:
            generation = self._generation[src]
            try:
                tag, control = self.transport.take_any(src, DISPATCH, 0, timeout_s=3600)
            except TransportError:
                continue   # idle, or the link was reset: wait for the next step
            try:
                try:
                    m, context = read_control(tag, control, src)   # before the slot is freed
                finally:
                    self.transport.release(src, tag)
                if m < 0:
                    return
                with tracing_detail.remote("afd.expert_step", context, step=tag.step, micro_batches=m) as trace:
                    self._serve_step(src, tag.step, m, generation, trace)
            except TransportError as e:
                self.rejected += 1
                log.warning("rejected a message from %s: %s", src, e)
                self.transport.reset(src)

    def _serve_step(self, src: str, step: int, m: int, generation: int,
                    trace: tracing_detail.StepTrace | None = None) -> None:
        for layer in range(len(self.shard.layers)):
            for mb in range(m):
                tag = Tag(step, mb, layer, DISPATCH)
                try:
                    message = self.transport.recv(src, tag, self.timeout_s).clone()
                    self.transport.release(src, tag)
                    t0 = time.perf_counter()
                    out = self.shard.compute(layer, message)
                    t1 = time.perf_counter()
                    self.compute_s += t1 - t0
                    self.batches += 1
                except (TransportError, RuntimeError, ValueError) as e:
                    self._reply_error(src, Tag(step, mb, layer, COMBINE), str(e))
                    raise TransportError(str(e)) from e
                if self._generation[src] != generation:
                    return   # the attention node reconnected: this step is gone
                self.tokens_in += message.shape[0]
                self.transport.send(src, Tag(step, mb, layer, COMBINE), out)
                if trace is not None:
                    trace.record("afd.expert", t0, t1, layer=layer, micro_batch=mb, tokens=int(message.shape[0]))
                    trace.record("m2n.send", t1, time.perf_counter(), layer=layer, micro_batch=mb)

    def _reply_error(self, src: str, tag: Tag, reason: str) -> None:
        try:
            send_error(self.transport, src, tag, reason)
        except TransportError:
            pass   # the sender is gone; it resynchronises when it reconnects

    def stop(self) -> None:
        self._stopped = True

    def join(self, timeout_s: float = 10.0) -> None:
        for t in self._threads.values():
            t.join(timeout_s)
