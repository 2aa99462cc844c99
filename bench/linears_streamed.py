"""SmolLM2's 121 decode linears (30 layers of qkv, o, gate_up, down, and the LM head), bf16,
weights streamed from memory (269 MB: more than the caches keep between passes), oneDNN's
blocked weights against the AMX tile kernel's packed ones, interleaved in one process.
    .venv/bin/python bench/linears_streamed.py [rows ...]      # default 8 16 32 64
"""
import sys
import time

import torch

from tessera_kernels import amx_linear

torch.set_num_threads(2)
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]   # (K, N)
weights = [torch.randn(N, K, dtype=torch.bfloat16) for K, N in SHAPES]
onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
tiles = [amx_linear.pack(w) for w in weights] if amx_linear.available() else None
for M in [int(a) for a in sys.argv[1:]] or [8, 16, 32, 64]:
    xs = {K: torch.randn(M, K, dtype=torch.bfloat16) for K, _ in SHAPES}
    runs = {"oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(xs[K], w, None, "none", [], "")
                               for (K, _), w in zip(SHAPES, onednn)]}
    if tiles is not None:
        runs["AMX tiles"] = lambda: [amx_linear.linear(xs[K], w, None, N) for (K, N), w in zip(SHAPES, tiles)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(2):                       # interleaved: the machine drifts within minutes
        for name, run in runs.items():
            run()
            t = time.perf_counter()
            for _ in range(10):
                run()
            times[name].append((time.perf_counter() - t) / 10 * 1e3)
    print(f"{M} rows: " + ", ".join(f"{n} {' / '.join(f'{v:.1f}' for v in ts)} ms" for n, ts in times.items()))
