"""SmolLM2's 121 decode linears (30 layers of qkv, o, gate_up, down, and the LM head), weights
streamed from memory (269 MB in bf16: more than the caches keep between passes), oneDNN's
blocked weights against the packed-weight kernels this CPU has (the AMX tiles, the register
tiles), interleaved in one process; best of three passes, ms per sweep and GFLOP/s.
    .venv/bin/python bench/linears_streamed.py [float32] [rows ...] [--out FILE]   # bf16; rows 8 16 32 64
"""
import sys
import time

import torch

from tessera_kernels import amx_linear, tile_linear

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path

torch.set_num_threads(2)
OUT = pop_out()
ROWS: list[dict] = []
args = sys.argv[1:]
dtype = torch.float32 if args[:1] == ["float32"] else torch.bfloat16
rows = [int(a) for a in args if a != "float32"] or [8, 16, 32, 64]
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]   # (K, N)
FLOPS_PER_ROW = sum(2 * K * N for K, N in SHAPES)
weights = [torch.randn(N, K).to(dtype) for K, N in SHAPES]
# oneDNN has no bf16 linear on AVX2-only CPUs ("bf16 path needs avx_ne_convert or avx512bw")
with_onednn = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights] if with_onednn else []
kernels = {name: (k, [k.pack(w) for w in weights]) for name, k, ok in
           (("AMX tiles", amx_linear, dtype == torch.bfloat16 and amx_linear.available()),
            ("register tiles", tile_linear, tile_linear.available(dtype))) if ok}
for M in rows:
    xs = {K: torch.randn(M, K).to(dtype) for K, _ in SHAPES}
    runs = {"oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(xs[K], w, None, "none", [], "")
                               for (K, _), w in zip(SHAPES, onednn)]} if with_onednn else {}
    for name, (k, packed) in kernels.items():
        if k.applies(xs[576], weights[0]):
            runs[name] = lambda k=k, packed=packed: [k.linear(xs[K], w, None, N) for (K, N), w in zip(SHAPES, packed)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    reps = max(2, 320 // M)
    for _ in range(3):                       # interleaved: the machine drifts within minutes
        for name, run in runs.items():
            run()
            t = time.perf_counter()
            for _ in range(reps):
                run()
            times[name].append((time.perf_counter() - t) / reps * 1e3)
    print(f"{M} rows, {dtype}: " + ", ".join(f"{n} {min(ts):.1f} ms ({FLOPS_PER_ROW * M / min(ts) / 1e6:.0f} GFLOP/s)"
                                           for n, ts in times.items()), flush=True)
    ref = min(times["oneDNN"]) * 1e3 if "oneDNN" in times else None
    ROWS.extend({"kernel": name, "shape": f"{M} rows x SmolLM2's 121 decode linears", "rows": M,
                 "dtype": str(dtype).removeprefix("torch."), "tessera_us": round(min(ts) * 1e3, 1),
                 "reference": "oneDNN" if ref else None, "reference_us": round(ref, 1) if ref else None,
                 "gflops": round(FLOPS_PER_ROW * M / min(ts) / 1e6)} for name, ts in times.items() if name != "oneDNN")
save(OUT, "kernel", "SmolLM2's decode linears, weights streamed from memory: packed kernels against oneDNN", ROWS)
