"""The machine's GEMM roofline for a model: the time of every linear layer of the model (its
own shapes and weights, LM head included, in the served dtype and quantization) run once at
M = batch rows, back to back in model order, as one decode step would run them.

Nothing else in a decode step is counted (attention, norms, sampling, Python), so
batch / that time is the most output tokens per second the engine could reach at this
batch size on this machine; `tessera bench engine` reports its decode rate as a fraction of it.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from tessera.layers.quant import Int4Linear, Int8Linear

LINEAR_TYPES = (nn.Linear, Int8Linear, Int4Linear)


def model_linears(model: nn.Module) -> list[nn.Module]:
    """Every linear the model runs per token, in forward order (a tied head counted once;
    the reference twins of quantized linears are nn.Linear too, and counted as they run)."""
    return [m for m in model.modules() if isinstance(m, LINEAR_TYPES)]


@torch.inference_mode()
def gemm_roofline(model: nn.Module, batch: int, dtype: torch.dtype, repeats: int = 20) -> dict:
    """Seconds per sweep of all linears at `batch` rows (best of `repeats`), and the GFLOP/s.
    Twenty sweeps, not five: on a shared VM a slow fraction of a second can halve the best of five."""
    linears = model_linears(model)
    inputs = {k: torch.randn(batch, k).to(dtype) for k in {m.in_features for m in linears}}
    best = float("inf")
    for _ in range(repeats + 1):     # the first sweep warms the kernels up
        start = time.perf_counter()
        for m in linears:
            m(inputs[m.in_features])
        best = min(best, time.perf_counter() - start)
    flops = 2 * batch * sum(m.in_features * m.out_features for m in linears)
    return {"gemm_s": best, "gemm_gflops": flops / best / 1e9, "roofline_tok_s": batch / best}
