"""Weight-only quantized linears: the weights are stored in 8, 4 or 3 bits, activations stay
16-bit. Decode reads every weight once per token, so fewer weight bytes is a faster token.

    int8   per output row, symmetric:        w = q * s            q in [-127, 127]
    int4   per group of G input columns,     w = q * s + m        q in [0, 15]
    int3   asymmetric (round to nearest):    w = q * s + m        q in [0, 7]

Each kind has its fake-quant reference (`fake_quant`: the dequantized weight, what the packed
kernel must reproduce). A quantized linear computes in bfloat16 whatever the model's dtype, and
its reference does the same. On CPU:
- int4 (and int3, whose codes ride in the int4 layout: quality of 3 bits, speed and memory of
  4) runs our C kernel (tessera_kernels.gemv_quant_cpu) for up to GEMV_MAX_ROWS rows: the
  decode step, where it widens the codes in registers; for more rows (prefill, big batches)
  the weight is dequantized to bf16 by the same library on each call (nothing cached: the
  point is memory) and multiplied by torch's GEMM.
  torch's own int4 kernel reads its quarter of the bytes slower than our dense bf16 path reads
  all of them (docs/benchmarks/quantization.md).
- int8 runs our C kernel for one or two rows and torch's aten._weight_int8pack_mm otherwise.
GGUF Q4_0/Q4_1 blocks are the int4 form with G = 32 (`Int4Linear.from_codes`; their fp16
scales and offsets rounded to bf16), so they are served without a dense copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera_kernels import gemv_quant_cpu

BITS = (3, 4, 8, 16)
COMPUTE_DTYPE = torch.bfloat16
# Rows up to which the C GEMVs beat the alternative on SmolLM2's linear shapes: int4 against
# dequantize + GEMM (even at 16 rows, well behind at 32), int8 against torch's packed kernel
# (ahead at 2 rows, behind at 4).
GEMV_MAX_ROWS = 16
GEMV_MAX_ROWS_INT8 = 2


@dataclass(frozen=True)
class QuantCodes:
    """Integer codes [N, K] and per-group scale and offset [N, K / group] of a weight [N, K]:
    w = q * scale + offset (int8: group = K, offset 0)."""
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // self.group, self.group)
        return (q * self.scale.float()[..., None] + self.offset.float()[..., None]).view(n, k)


def row_scale(w: torch.Tensor) -> torch.Tensor:
    """int8's symmetric scale of every row of w [N, K] -> [N], as stored (bfloat16), in float32."""
    return (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(COMPUTE_DTYPE).float()


def group_scale_offset(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4/int3's asymmetric scale and offset of groups g [..., G] -> [...] each, as stored
    (bfloat16), in float32: the group's range over 2^bits - 1 steps, from its minimum."""
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-8).to(COMPUTE_DTYPE).float()
    return scale, lo.to(COMPUTE_DTYPE).float()


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int = 32) -> QuantCodes:
    """Round-to-nearest codes of weight w [N, K]: int8 symmetric per row; int4/int3
    asymmetric per group of `group_size` columns (K must be a multiple of it). Scales and
    offsets are rounded to bfloat16 first, so the codes are the best ones for the stored scales."""
    w = w.detach().float()
    n, k = w.shape
    if bits == 8:
        scale = row_scale(w)[:, None]
        codes = (w / scale).round().clamp(-127, 127).to(torch.int8)
        return QuantCodes(codes, scale.to(COMPUTE_DTYPE), torch.zeros_like(scale, dtype=COMPUTE_DTYPE), k)
    if bits not in (3, 4):
        raise ValueError(f"weight-only quantization supports 3, 4 and 8 bits, not {bits}")
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the group size {group_size}")
    g = w.view(n, k // group_size, group_size)
    scale, offset = group_scale_offset(g, bits)
    codes = ((g - offset[..., None]) / scale[..., None]).round().clamp(0, 2 ** bits - 1).to(torch.uint8)
    return QuantCodes(codes.view(n, k), scale.to(COMPUTE_DTYPE), offset.to(COMPUTE_DTYPE), group_size)


def fake_quant(w: torch.Tensor, bits: int, group_size: int = 32) -> torch.Tensor:
    """The reference: w quantized and dequantized (float32); 16 bits returns w unchanged."""
    return w if bits == 16 else quantize_rtn(w, bits, group_size).dequantize()


class _PackedFormat(nn.Module):
    """A module whose buffers `_format` are a packed weight (codes and their bf16 scales):
    .half(), .float() and the like leave them as they are (the kernels read them so), .to(device)
    moves them, and whatever replaces them (load_state_dict) is checked again."""
    _format: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers.pop(name) for name in self._format}
        super()._apply(fn, recurse)
        device = fn(torch.empty(0)).device      # where fn sends tensors
        for name, t in kept.items():
            self._buffers[name] = t.to(device)
        self._formatted()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._formatted()

    def _formatted(self) -> None:
        """Check the packed buffers again after they changed."""


class Int8Linear(_PackedFormat):
    """y = x W^T + b with W stored as int8 codes and one bfloat16 scale per output row."""
    bits = 8
    _format = ("codes", "scale")

    def __init__(self, q: QuantCodes, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("codes", q.codes.to(torch.int8).contiguous())
        self.register_buffer("scale", q.scale.reshape(-1).to(COMPUTE_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = self.codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)
        if (x2.shape[0] <= GEMV_MAX_ROWS_INT8 and self.in_features % 16 == 0 and x.device.type == "cpu"
                and self.codes.device.type == "cpu" and gemv_quant_cpu.available()):
            y = gemv_quant_cpu.gemv_q8(x2, self.codes, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.codes, self.scale)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(_PackedFormat):
    """y = x W^T + b with W stored as 4-bit codes (gemv_quant_cpu.pack_q4's layout) and a
    bfloat16 scale and offset per group of `group` input columns. Holds 3-bit codes the same
    way."""
    _format = ("packed", "scale", "offset")

    def __init__(self, q: QuantCodes, bias: torch.Tensor | None = None, bits: int = 4) -> None:
        super().__init__()
        if q.group % gemv_quant_cpu.RUN:
            raise ValueError(f"int{bits} groups must be a multiple of {gemv_quant_cpu.RUN} columns, not {q.group}")
        self.bits, self.group = bits, q.group
        self.out_features, self.in_features = q.codes.shape
        self.register_buffer("packed", gemv_quant_cpu.pack_q4(q.codes))
        self.register_buffer("scale", q.scale.to(COMPUTE_DTYPE).contiguous())
        self.register_buffer("offset", q.offset.to(COMPUTE_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._formatted()

    def _formatted(self) -> None:
        self._q4 = gemv_quant_cpu.Q4Weight(self.packed, self.scale, self.offset, self.in_features)

    @classmethod
    def from_codes(cls, q: QuantCodes, bias: torch.Tensor | None = None) -> "Int4Linear":
        """From 4-bit codes made elsewhere (GGUF Q4_0/Q4_1 blocks)."""
        return cls(q, bias, bits=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this a hundred times: the common case (2-D bf16) costs no copies
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if (x2.shape[0] <= GEMV_MAX_ROWS and self._q4.on_cpu and x.device.type == "cpu"
                and gemv_quant_cpu.available()):
            y = self._q4.gemv(x2)
        else:
            y = F.linear(x2.to(COMPUTE_DTYPE), self._q4.dequantize())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def decode_regimes(bits: int, dtype: torch.dtype) -> tuple[tuple[int, int], ...]:
    """How a linear of this bit-width runs b rows on this machine, as the forwards above (and
    layers/linear.py for 16 bits) choose: (most rows, rows per pass over the weights) for each
    kernel in turn, the last one taking every larger b (most rows 0). The cost model fits one
    decode regression per regime (pipeline/costmodel.py: Piecewise). Inside the int4 GEMV one
    row takes its own path (exact float32 weights; csrc/gemv_quant.c), and torch's packed int8
    kernel costs a step every 4 rows (5 rows cost about what 8 do)."""
    from tessera_kernels import gemv_cpu
    if bits == 16:
        gemv = dtype == torch.bfloat16 and gemv_cpu.available()
        return ((gemv_cpu.MAX_ROWS, 1), (0, 1)) if gemv else ((0, 1),)        # one pass for all its rows
    if not gemv_quant_cpu.available():
        return ((0, 1),)
    if bits == 8:
        return ((GEMV_MAX_ROWS_INT8, 1), (0, 4))
    return ((1, 1), (GEMV_MAX_ROWS, gemv_quant_cpu.ROWS_PER_PASS), (0, 1))


def quantized_linear(linear: nn.Linear, bits: int, group_size: int = 32) -> nn.Module:
    """The quantized replacement of `linear` (16 bits: the linear itself)."""
    if bits == 16:
        return linear
    q = quantize_rtn(linear.weight, bits, group_size)
    if bits == 8:
        return Int8Linear(q, linear.bias)
    return Int4Linear(q, linear.bias, bits=bits)


def reference_linear(linear: nn.Linear, bits: int, group_size: int = 32) -> nn.Module:
    """The fake-quant twin of quantized_linear: a bfloat16 nn.Linear holding the dequantized
    weight (16 bits: the linear itself). Tests compare the packed kernels against it."""
    if bits == 16:
        return linear
    ref = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    dtype=COMPUTE_DTYPE, device="meta")
    ref.weight = nn.Parameter(fake_quant(linear.weight, bits, group_size).to(COMPUTE_DTYPE), requires_grad=False)
    if linear.bias is not None:
        ref.bias = nn.Parameter(linear.bias.detach().to(COMPUTE_DTYPE), requires_grad=False)
    return _Bf16(ref)


class _Bf16(nn.Module):
    """Runs a module in bfloat16 and returns the caller's dtype (as the quantized kernels do)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(COMPUTE_DTYPE)).to(x.dtype)


def _skip(name: str) -> bool:
    """MoE routers stay in full precision (tiny, and a flipped expert choice costs more than
    it saves), as in vLLM and llama.cpp."""
    return name.endswith("router.gate") or name.endswith("shared_gate")


def layer_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear modules of a decoder layer that weight-only quantization replaces."""
    return [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear) and not _skip(n)]


def parse_quantization(spec: str | None, num_layers: int) -> list[int] | str | None:
    """--quantization: None (dense), 'int8' | 'int4' | 'int3' (every decoder layer), 'gguf'
    (a GGUF's own Q4 blocks), or a JSON file with {"bits": [one per layer]} (a `tessera plan
    pq` plan). Returns per-layer bits, 'gguf' or None."""
    if spec in (None, "", "none"):
        return None
    if spec == "gguf":
        return "gguf"
    if spec in ("int8", "int4", "int3"):
        return per_layer_bits(int(spec[3:]), num_layers)
    import json
    import pathlib
    path = pathlib.Path(spec)
    if not path.is_file():
        raise ValueError(f"--quantization {spec!r}: choose int8, int4, int3, gguf or a plan file with 'bits'")
    return per_layer_bits(json.loads(path.read_text())["bits"], num_layers)


def per_layer_bits(bits: int | Sequence[int], num_layers: int) -> list[int]:
    """One bit-width per layer from an int or a sequence (checked)."""
    out = [int(bits)] * num_layers if isinstance(bits, int) else [int(b) for b in bits]
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} bit-widths for {num_layers} layers")
    bad = sorted({b for b in out if b not in BITS})
    if bad:
        raise ValueError(f"unsupported bit-widths {bad} (choose from {BITS})")
    return out


def quantize_model(model: nn.Module, bits: int | Sequence[int], group_size: int = 32,
                   reference: bool = False) -> None:
    """Replace, in place, the linears of decoder layer l by their bits[l] form (16: unchanged).
    Layers a node does not hold (attn or ffn set to None) are skipped. reference=True installs
    the fake-quant twins instead of the packed kernels."""
    make = reference_linear if reference else quantized_linear
    for layer, b in zip(model.layers, per_layer_bits(bits, len(model.layers))):
        if b == 16:
            continue
        for name, linear in layer_linears(layer):
            replace_module(layer, name, make(linear, b, group_size))


def replace_module(root: nn.Module, dotted: str, new: nn.Module) -> None:
    """Put `new` where root's submodule `dotted` (e.g. 'layers.3.attn.qkv_proj') is."""
    parent, _, attr = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def linear_weight_bytes(out_features: int, in_features: int, bits: int, group_size: int = 32,
                        dense_bytes: int = 2) -> int:
    """Bytes a linear's weight takes at `bits` (scales and offsets included): the memory model."""
    n = out_features * in_features
    if bits == 16:
        return n * dense_bytes
    if bits == 8:
        return n + 2 * out_features
    rows, row_bytes = gemv_quant_cpu.packed_q4_shape(out_features, in_features)   # int3 rides in int4's layout
    return rows * row_bytes + 4 * out_features * (in_features // group_size)

