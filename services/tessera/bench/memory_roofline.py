"""`tessera bench roofline`: the memory roofline of one decode stream. At batch 1 every weight
is read once per output token, so no engine on this machine can decode faster than

    roofline TPOT = bytes of weights read per token / streaming-read bandwidth

Bytes per token: every tensor of the checkpoint (each linear, the norms) in the served dtype, and
the head; the input embedding is a gather of one row (negligible), so a tied embedding is counted
once, as the head. The KV cache read is not counted (it grows with the context; at 128/128 it is
small next to the weights). Bandwidth: a reduction over a buffer far larger than the caches, on
`threads` cores, best of several passes. With --tpot-ms, the fraction measured / roofline (>= 1).

With --gemm-rows R, the other roof too: the rate (GFLOP/s) at which this machine multiplies R rows
by each of the checkpoint's linear weights (the head included, a tied one once) in the served
dtype, and the FLOPs of one token through them. Past a dozen or so rows a step is bound by that
rate, not by the memory: a run of many requests cannot end sooner than its tokens x
flop_per_token / gemm_gflops, whatever the server (attention, a few percent at short contexts,
is not counted).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import struct
import sys
import time

# bytes per element of the safetensors dtypes a checkpoint holds
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
SERVED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tensor_shapes(model_dir: str | pathlib.Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor in the directory's model*.safetensors,
    read from the headers alone (nothing is loaded)."""
    files = sorted(pathlib.Path(model_dir).glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {model_dir}")
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out |= {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return out


def weight_bytes_per_token(model_dir: str | pathlib.Path, dtype: str | None = None) -> int:
    """Bytes of weights one decode step reads (module docstring); each tensor at `dtype`'s width
    (None: as stored)."""
    total = 0
    tensors = tensor_shapes(model_dir)
    for name, (stored, shape) in tensors.items():
        if name == EMBEDDING and HEAD in tensors:
            continue            # untied: the gather of one row is all the embedding costs
        width = SERVED_BYTES[dtype] if dtype else DTYPE_BYTES[stored]
        total += math.prod(shape) * width
    return total


def linear_shapes(model_dir: str | pathlib.Path) -> collections.Counter:
    """(in_features, out_features) -> how many of the checkpoint's linears have that shape: its
    two-dimensional weights, the head once (a tied embedding as the head)."""
    tensors = tensor_shapes(model_dir)
    shapes = collections.Counter()
    for name, (_, shape) in tensors.items():
        if len(shape) == 2 and name.endswith(".weight") and not (name == EMBEDDING and HEAD in tensors):
            shapes[shape[1], shape[0]] += 1
    return shapes


def gemm_rate(model_dir: str | pathlib.Path, rows: int, dtype: str = "bfloat16", threads: int = 2,
              repeats: int = 10) -> dict:
    """GFLOP/s of `rows` rows through every linear of the checkpoint in `dtype` (each distinct
    shape timed alone, best of `repeats`, on random values: at this many rows the product is
    bound by the arithmetic, so which weights and whether they are cached hardly matter), and
    FLOPs per token (2 per weight)."""
    import torch
    import torch.nn.functional as F
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    width = getattr(torch, dtype)
    try:
        seconds = 0.0
        for (K, N), count in linear_shapes(model_dir).items():
            x, w = torch.randn(rows, K).to(width), torch.randn(N, K).to(width)
            best = math.inf
            for _ in range(repeats + 1):
                start = time.perf_counter()
                F.linear(x, w)
                best = min(best, time.perf_counter() - start)
            seconds += count * best
    finally:
        torch.set_num_threads(before)
    flop_per_token = 2 * sum(K * N * count for (K, N), count in linear_shapes(model_dir).items())
    return {"gemm_rows": rows, "gemm_gflops": round(flop_per_token * rows / seconds / 1e9, 1),
            "flop_per_token": flop_per_token}


def stream_read_gbs(gib: float = 1.0, threads: int = 2, repeats: int = 10) -> float:
    """GB/s (1e9 bytes) of reading `gib` GiB of float32 once (a sum, so nothing is written back),
    on `threads` threads, best of `repeats` passes after one that faults the pages in."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        best = math.inf
        for _ in range(repeats + 1):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def roofline(model_dir: str | pathlib.Path, bandwidth_gbs: float, tpot_ms: float | None = None,
             dtype: str | None = None) -> dict:
    """The roofline TPOT of `model_dir` at `bandwidth_gbs`, and with `tpot_ms` its fraction."""
    nbytes = weight_bytes_per_token(model_dir, dtype)
    roof_ms = nbytes / (bandwidth_gbs * 1e9) * 1e3
    out = {"model": str(model_dir), "weight_bytes_per_token": nbytes, "bandwidth_gbs": round(bandwidth_gbs, 2),
           "roofline_tpot_ms": round(roof_ms, 3)}
    if tpot_ms is not None:
        out |= {"tpot_ms": tpot_ms, "fraction": round(tpot_ms / roof_ms, 3)}
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face directory (model*.safetensors)")
    p.add_argument("--tpot-ms", type=float, default=None,
                   help="a measured one-stream TPOT: also print it as a fraction of the roofline's")
    p.add_argument("--dtype", default=None, choices=sorted(SERVED_BYTES),
                   help="the served dtype's width for every tensor (default: as stored)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="use this bandwidth instead of measuring it")
    p.add_argument("--gib", type=float, default=1.0, help="size of the buffer the bandwidth is read from")
    p.add_argument("--threads", type=int, default=2, help="threads reading it (the cores the server uses)")
    p.add_argument("--gemm-rows", type=int, default=None,
                   help="also measure the compute roof: the GEMM rate at this many rows (module docstring)")
    p.add_argument("--json", action="store_true")


def main(a: argparse.Namespace) -> int:
    bandwidth = a.bandwidth_gbs or stream_read_gbs(a.gib, a.threads)
    r = roofline(a.model, bandwidth, a.tpot_ms, a.dtype) | {"threads": a.threads}
    if a.gemm_rows:
        r |= gemm_rate(a.model, a.gemm_rows, a.dtype or "bfloat16", a.threads)
    if a.json:
        print(json.dumps(r))
    else:
        line = (f"{r['weight_bytes_per_token'] / 1e9:.3f} GB of weights per token at {r['bandwidth_gbs']} GB/s: "
                f"roofline TPOT {r['roofline_tpot_ms']} ms")
        print(line + (f"; measured {r['tpot_ms']} ms = {r['fraction']}x" if "fraction" in r else ""))
        if "gemm_gflops" in r:
            print(f"{r['flop_per_token'] / 1e9:.3f} GFLOP per token through the linears at {r['gemm_gflops']} GFLOP/s "
                  f"({r['gemm_rows']} rows): at most {r['gemm_gflops'] * 1e9 / r['flop_per_token']:.0f} tokens/s "
                  f"once a step is compute-bound")
    return 0
