"""Quantization-sensitivity indicator ω[layer, bits] (LLM-PQ's "variance indicator",
docs/design/pipeline.md#indicator), for `tessera plan pq`: lower ω = the layer loses less at that
bit-width.

Three forms, all from calibration text (quality.py's first half of pydoc_data.topics):

- `omega_kl` (the default that `tessera indicator` writes as "omega"): ZeroQ's sensitivity
  (Cai et al., 2020). Quantize layer l alone to b bits and measure the mean KL divergence, per
  token, of the model's next-token distribution from the unquantized one. Only the layers from
  l on are run again: everything before l is unchanged, so its output is kept from the
  reference pass.
- `omega` (kept as "omega_variance"): the expected squared output error that round-to-nearest
  noise adds to each linear, from input statistics alone. Noise uniform within a step has
  variance step^2 / 12, so per token

      ω_linear(b) = Σ_n Σ_k step_b(n, group(k))^2 / 12 · E[x_k^2]

  with our quantizer's own steps (int8: per row; int3/int4: per group of G columns).
- `omega_paper`: the paper's cruder form, (max row range / (2^(b-1) - 1))^2 · Σ Var(x).

Why the measured form is the default: against the held-out perplexity increase of quantizing one
layer at a time, the two statistic-only forms rank SmolLM2's layers little better than chance, and
so do second-order (Fisher-weighted) estimates, while the KL of a layer alone ranks them about as
well as two held-out halves rank each other (docs/design/pipeline.md#indicator; the numbers are in
docs/benchmarks/pipeline.md). A linear's output error is not what the loss sees: later layers and
the residual stream decide how much of it survives. `validate` measures what the indicator
predicts: the held-out perplexity increase of quantizing one layer at a time.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
from dataclasses import dataclass, field

import torch

from tessera.layers.quant import fake_quant, layer_linears
from tessera.models.driver import run_layers
from tessera.models.llama import CausalLM
from tessera.pipeline import quality

BITS = (3, 4, 8, 16)


@dataclass
class LinearStats:
    """Input statistics of one linear over the calibration tokens."""
    sq_sum: torch.Tensor                 # Σ_tokens x_k^2, per input column [K]
    var_sum: float = 0.0                 # Σ_tokens Var_k(x) (the paper's statistic)
    tokens: int = 0
    weight: torch.Tensor = field(default=None)  # type: ignore[assignment]


@torch.inference_mode()
def calibrate(model: CausalLM, token_windows: list[list[int]]) -> list[dict[str, LinearStats]]:
    """Per layer, per linear name: input statistics over all windows."""
    stats: list[dict[str, LinearStats]] = []
    hooks = []
    for layer in model.layers:
        per_layer: dict[str, LinearStats] = {}
        for name, linear in layer_linears(layer):
            s = per_layer[name] = LinearStats(torch.zeros(linear.in_features), weight=linear.weight)
            hooks.append(linear.register_forward_pre_hook(_recorder(s)))
        stats.append(per_layer)
    try:
        for tokens in token_windows:
            quality.hidden_states(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _recorder(s: LinearStats):
    def hook(module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        s.sq_sum += x.pow(2).sum(0)
        s.var_sum += x.var(dim=-1, unbiased=False).sum().item()
        s.tokens += x.shape[0]
    return hook


def rtn_steps(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Our quantizer's step for every weight [N, K] (0 at 16 bits)."""
    w = w.detach().float()
    if bits == 16:
        return torch.zeros_like(w)
    if bits == 8:
        return (w.abs().amax(dim=1, keepdim=True) / 127).expand_as(w)
    g = w.view(w.shape[0], -1, group_size)
    step = (g.amax(-1) - g.amin(-1)) / (2 ** bits - 1)
    return step.repeat_interleave(group_size, dim=1)


def omega(stats: list[dict[str, LinearStats]], bits=BITS, group_size: int = 32) -> list[list[float]]:
    """ω[layer][i] for bits[i]: expected squared output error per token, summed over linears."""
    return [[sum(float((rtn_steps(s.weight, b, group_size) ** 2 / 12 * (s.sq_sum / s.tokens)).sum())
                 for s in layer.values()) for b in bits] for layer in stats]


def omega_paper(stats: list[dict[str, LinearStats]], bits=BITS) -> list[list[float]]:
    """The paper's form: (max row range / (2^(b-1) - 1))^2 · mean Σ Var(x), per linear."""
    def score(s: LinearStats, b: int) -> float:
        if b == 16:
            return 0.0
        w = s.weight.float()
        step = (w.amax(1) - w.amin(1)).max().item() / (2 ** (b - 1) - 1)
        return step ** 2 * s.var_sum / max(s.tokens, 1)
    return [[sum(score(s, b) for s in layer.values()) for b in bits] for layer in stats]


@contextlib.contextmanager
def quantized(layer: torch.nn.Module, bits: int, group_size: int = 32):
    """Inside the block, `layer`'s linears hold their fake-quantized weights; restored after."""
    saved = [(lin, lin.weight.detach().clone()) for _, lin in layer_linears(layer)]
    try:
        with torch.inference_mode():
            for lin, w in saved:
                lin.weight.copy_(fake_quant(w, bits, group_size))
        yield
    finally:
        with torch.inference_mode():
            for lin, w in saved:
                lin.weight.copy_(w)


@torch.inference_mode()
def omega_kl(model: CausalLM, token_windows: list[list[int]], bits=BITS, group_size: int = 32) -> list[list[float]]:
    """ω[layer][i] for bits[i]: mean KL(p || p_quantized) per token, nats, with layer l alone
    quantized to bits[i] (0 at 16 bits)."""
    n = len(model.layers)
    kl = [[0.0] * len(bits) for _ in range(n)]
    tokens, runner = 0, None
    for window in token_windows:
        batch, runner = quality.window_batch(model, window, runner)
        x, inputs = model.embed_tokens(batch.input_ids), []
        for l in range(n):
            inputs.append(x)
            x = run_layers(model, x, batch, runner.kv_caches, range(l, l + 1))
        reference = _log_probs(model, x)
        p = reference.exp()
        for l, layer in enumerate(model.layers):
            for i, b in enumerate(bits):
                if b == 16:
                    continue
                with quantized(layer, b, group_size):
                    y = run_layers(model, inputs[l], batch, runner.kv_caches, range(l, n))
                kl[l][i] += float((p * (reference - _log_probs(model, y))).sum())
        tokens += len(window)
    return [[v / tokens for v in row] for row in kl]


def _log_probs(model: CausalLM, x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model.compute_logits(model.norm(x)).float(), dim=-1)


@torch.inference_mode()
def one_layer_perplexities(model: CausalLM, token_windows: list[list[int]], bits: int,
                           group_size: int = 32) -> list[float]:
    """Held-out perplexity with layer l alone fake-quantized to `bits`, for every l."""
    out = []
    for layer in model.layers:
        with quantized(layer, bits, group_size):
            out.append(quality.perplexity(model, token_windows))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected in measured floats)."""
    ra = torch.tensor(a).argsort().argsort().float()
    rb = torch.tensor(b).argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def write(path: str | pathlib.Path, forms: dict[str, list[list[float]]], kind: str, group_size: int,
          meta: dict) -> None:
    """The file `tessera plan pq --indicator` reads: {"bits", "omega": [[per bit] per layer]};
    "omega" is the form named by `kind`, every form is also written as "omega_<form>"."""
    body = {"bits": list(BITS), "omega": forms[kind], "omega_kind": kind, "group_size": group_size,
            **{f"omega_{k}": v for k, v in forms.items()}, **meta}
    pathlib.Path(path).write_text(json.dumps(body, indent=1))
