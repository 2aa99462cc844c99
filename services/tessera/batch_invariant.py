"""The batch-invariant mode (--batch-invariant): a token's logits bitwise the same whatever was
computed beside it, so that a request alone equals the same request among others, a seeded
stream that fails over continues as it would have, and speculative greedy equals plain greedy
in bf16 as it does in float32.

A token's bits change with its batch where a kernel's summation order depends on the shapes it
is given: the linears take a GEMV below 5 rows and packed tiles above (or oneDNN, or AMX tiles
in two passes); prompt rows attend 16 at a time as the lanes of one tile, decode rows one at a
time, long prompts through SDPA on AMX. In this mode every linear runs on the register tiles
at every row count (each output element sums its products in one order, set by the packed
panels: layers/linear.py) and every attention row runs the one-row path of the paged kernel,
prompt and tree rows included (layers/attention.py). Elementwise layers (norms, RoPE, the
activation) are per row already.

The bits then still depend on the kernel path, the instruction set and the kernels' build, so
the mode puts that path into the compatibility hash: a stream fails over only to a replica that
computes as this one does.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from tessera.config import ConfigError


def apply(model: nn.Module, dtype: torch.dtype, quantization: str | None) -> None:
    """Put every linear and attention layer of the model in the mode, or refuse with a
    ConfigError where it cannot be kept."""
    from tessera.layers.linear import Linear, set_batch_invariant
    from tessera_kernels import tile_linear
    if quantization:
        raise ConfigError("--batch-invariant covers dense weights: quantized linears switch kernels with the row "
                          "count", "batch_invariant")
    if any(isinstance(p, nn.Parameter) and p.dim() == 3 for p in model.parameters()):
        raise ConfigError("--batch-invariant covers dense models: the experts of a mixture-of-experts model run "
                          "on as many rows as the router gives them", "batch_invariant")
    probe = torch.zeros(1, 32, dtype=dtype)
    if not tile_linear.applies(probe, torch.zeros(48, 32, dtype=dtype), every_row_count=True):
        raise ConfigError(f"--batch-invariant needs the register-tile linears, which this CPU or build lacks "
                          f"for {str(dtype).removeprefix('torch.')}", "batch_invariant")
    from tessera_kernels import paged_attention_cpu
    if not (paged_attention_cpu.available() and paged_attention_cpu.supports(model.config.head_dim)):
        raise ConfigError("--batch-invariant needs the paged attention kernel, which this build or this model's "
                          f"head size ({model.config.head_dim}) lacks", "batch_invariant")
    set_batch_invariant(model, True)
    for module in model.modules():
        if hasattr(module, "batch_invariant") and not isinstance(module, Linear):
            module.batch_invariant = True


def kernel_path(dtype: torch.dtype) -> str:
    """What the bits depend on besides the model: the kind of CPU, the instruction-set flags
    the kernels choose by, the target they were built for and the bf16 tiles chosen."""
    from tessera.cpu_kind import describe_cpu
    from tessera_kernels import tile_linear
    cpu = describe_cpu()
    tiles = tile_linear.bf16_tiles() if dtype == torch.bfloat16 else "f32"
    return "/".join([cpu["kind"], "+".join(cpu["flags"]), os.environ.get("TESSERA_MARCH", "native"), tiles])
