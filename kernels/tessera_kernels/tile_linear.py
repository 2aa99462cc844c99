"""Linears by register tiles over a weight packed once into panels of output columns
(csrc/tile_linear_bf16.c, csrc/tile_linear_f32.c), where oneDNN leaves the vector units idle:

- bf16, 5 rows or more, on CPUs without AMX (AMD Zen 4 and Zen 5 first): a decode step at a
  large batch and every prompt chunk are bound by the bf16 dot products there, and oneDNN's
  matmul leaves a good part of the vdpbf16ps throughput unused. Intel cores without AMX run
  vdpbf16ps at about half their FMA rate, so there the same panels go through float32 FMAs
  instead (bf16_tiles() measures which of the two is faster, once per process). Cores without
  AVX512-BF16 get the FMA tiles only, where torch emulates bf16 products: 16 lanes on AVX-512
  (with them, bf16 decodes faster than float32 and is --dtype auto there), 8 on AVX2, where
  from 16 rows on each panel is unpacked to float32 for the float32 tile, which then runs at
  float32's speed (bf16 is auto there too).
- float32, any row count, on CPUs with AVX2 and FMA (--dtype float32): oneDNN keeps part of the
  FMA units idle at these shapes (see the C source).
The measurements are in docs/performance-notes.md.

For bf16 where the CPU has AMX (the AMX kernel and oneDNN run bf16 there), and for either dtype
where it lacks the vector units, applies() is False and callers keep oneDNN;
TESSERA_DISABLE_TILE_LINEAR=1 does the same on purpose (to compare the two).
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import time

import torch

from tessera_kernels import cbuild, replay

NV_MAX = 3           # column blocks per panel, as in the C sources
BF16_MIN_ROWS = 5    # below: the bf16 GEMV kernel (gemv_cpu), which streams weights at memory speed


@functools.cache   # every linear asks (os.environ is a dict lookup and a decode: ~2 us a call)
def _library(dtype: torch.dtype) -> tuple[ctypes.CDLL, int] | None:
    """The kernel for this dtype and its lanes per vector (the column block's width), unless
    TESSERA_DISABLE_TILE_LINEAR=1 (read once per process) keeps the callers on oneDNN."""
    return None if os.environ.get("TESSERA_DISABLE_TILE_LINEAR") == "1" else _built(dtype)


_KERNELS = {torch.bfloat16: "tile_linear_bf16", torch.float32: "tile_linear_f32"}


@functools.cache
def _built(dtype: torch.dtype, on_amx: bool = False) -> tuple[ctypes.CDLL, int] | None:
    """The kernel for this dtype where this CPU has its vector units and it builds (for bf16 on
    a CPU with AMX only when on_amx: the batch-invariant mode's linears)."""
    flags = cbuild.cpu_flags()
    if dtype not in _KERNELS or not {"avx2", "fma"} <= flags or (
            dtype == torch.bfloat16 and "amx_bf16" in flags and not on_amx):
        return None
    name = _KERNELS[dtype]
    lib = cbuild.load(name)
    lanes = getattr(lib, f"{name}_lanes")() if lib is not None else 0
    if lanes == 0 or (lanes == 16 and "avx512f" not in flags):   # a TESSERA_MARCH wider than the CPU
        return None
    if dtype == torch.bfloat16 and lib.tile_linear_bf16_built() == 2 and "avx512_bf16" not in flags:
        return None
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
                   + [ctypes.c_int] * (dtype == torch.bfloat16))   # bf16: 1 for the FMA tiles
    return fn, lanes


TILES = ("dot", "fma")   # bf16: vdpbf16ps tiles, or float32 FMAs over the same packed weight


_chosen: list[str] = []        # bf16_tiles()'s answer, made once per process
_choosing = threading.Lock()    # two threads never time the tiles at once (nor get two answers)


def bf16_tiles() -> str:
    """The bf16 tiles this CPU runs faster: each timed on the same in-cache product (8 rows, K
    1024, 192 columns: compute-bound, ~3 MFLOP), one thread, best of 15 interleaved calls; where
    one is much the faster (dot where vdpbf16ps runs at full rate, fma on Intel cores without
    AMX) drift cannot flip the choice. TESSERA_BF16_TILES=dot|fma chooses instead."""
    if _chosen:                   # every bf16 linear asks: no lock once the answer is made
        return _chosen[0]
    with _choosing, replay.paused():     # a step being recorded may ask first: not part of it
        if not _chosen:
            _chosen.append(_faster_tiles())
        return _chosen[0]


def _faster_tiles() -> str:
    if built_tiles() == ("fma",):
        return "fma"
    chosen = os.environ.get("TESSERA_BF16_TILES")
    if chosen in TILES:
        return chosen
    if _built(torch.bfloat16) is None:
        return "dot"   # no bf16 tiles here to time (nor to run)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 1024, generator=g).bfloat16(), torch.randn(192, 1024, generator=g).bfloat16()
    packed, best = pack(w), dict.fromkeys(TILES, float("inf"))
    for _ in range(15):
        for tiles in TILES:
            t = time.perf_counter()
            _linear(x, packed, None, 192, 1, tiles)
            best[tiles] = min(best[tiles], time.perf_counter() - t)
    return min(TILES, key=best.get)


def built_tiles() -> tuple[str, ...]:
    """The bf16 tiles this CPU runs: both where the kernel was built with AVX512-BF16, else the
    FMA ones only."""
    if _built(torch.bfloat16) is None:
        return ()
    return TILES if cbuild.load("tile_linear_bf16").tile_linear_bf16_built() == 2 else ("fma",)


def without_dot_bf16() -> tuple[str, ...]:
    """Build flags for the other kernels that use vdpbf16ps where the CPU has it (attention):
    -mno-avx512bf16 where bf16_tiles() found FMAs faster here, so their float32 paths run."""
    return ("-mno-avx512bf16",) if _built(torch.bfloat16) is not None and bf16_tiles() == "fma" else ()


def available(dtype: torch.dtype) -> bool:
    return _library(dtype) is not None


def applies(x: torch.Tensor, w: torch.Tensor, every_row_count: bool = False) -> bool:
    """bf16 (5 rows or more) or float32 on the CPU, rows each contiguous and at least K apart
    (not an expanded view), N a multiple of the kernel's column block, bf16's K even, and the
    kernel built for this CPU. every_row_count: the batch-invariant mode's question, any number
    of rows and bf16 on AMX CPUs too: a row's result is the same whatever the rows beside it
    (each output element sums its K products in one order, fixed by the panel layout)."""
    if not (x.dtype == w.dtype and x.device.type == w.device.type == "cpu" and x.dim() == 2 and w.dim() == 2
            and x.shape[0] >= (1 if every_row_count or x.dtype != torch.bfloat16 else BF16_MIN_ROWS)
            and x.shape[1] == w.shape[1] > 0 and w.shape[0] > 0
            and x.stride(1) == 1 and x.stride(0) >= x.shape[1]):
        return False
    lib = _built(x.dtype, on_amx=True) if every_row_count else _library(x.dtype)
    return lib is not None and w.shape[0] % lib[1] == 0 and w.shape[1] % _pair(w.dtype) == 0


def _pair(dtype: torch.dtype) -> int:
    """Inputs per dot product: vdpbf16ps takes two bf16 inputs a lane, an FMA one float."""
    return 2 if dtype == torch.bfloat16 else 1


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the kernel's panel order (see the C sources): full panels of NV_MAX blocks of
    L columns as [K / pair, NV_MAX, L, pair], then the last, narrower panel the same way."""
    N, K = w.shape
    lanes, pair = _built(w.dtype, on_amx=True)[1], _pair(w.dtype)
    full = N // (lanes * NV_MAX) * lanes * NV_MAX
    parts = []
    for start, stop, nv in ((0, full, NV_MAX), (full, N, (N - full) // lanes)):
        if stop > start:
            part = w[start:stop].reshape(-1, nv, lanes, K // pair, pair)    # [panel, block, j, p, q]
            parts.append(part.permute(0, 3, 1, 2, 4).reshape(-1))          # [panel, p, block, j, q]
    return torch.cat(parts).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int,
           tiles: str | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, W given packed; callers check applies()
    first. tiles (bf16): bf16_tiles() unless given."""
    return _linear(x, packed, bias, N, torch.get_num_threads(), tiles)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int, threads: int,
            tiles: str | None) -> torch.Tensor:
    M, K = x.shape
    if packed.dtype != x.dtype or packed.numel() != N * K:
        raise ValueError(f"tile_linear: a packed weight of {packed.numel()} {packed.dtype} for x {tuple(x.shape)} and N={N}")
    y = torch.empty(M, N, dtype=x.dtype)
    b = None if bias is None else bias.float().contiguous()   # both kernels add a float32 bias
    fn = _built(x.dtype, on_amx=True)[0]
    fma = () if x.dtype != torch.bfloat16 else (TILES.index(tiles or bf16_tiles()),)
    status = fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                M, N, K, threads, *fma)
    if status == -2:
        raise MemoryError(f"tile_linear: no memory for x or the weight panels in float32 ({M} x {K})")
    if status != 0:
        raise ValueError(f"tile_linear: shapes out of range (M={M}, N={N}, K={K})")
    return y
