"""Served throughput of this working tree against an earlier commit, on this machine, in
alternating rounds (base, this, base, this, ...): `tessera serve` of the default model in
bfloat16, then `tessera bench serve` (64 prompts x 128 in / 128 out, all at once) against it.
Prints each round and the ratio of the medians; `--out FILE` writes a result file.

    .venv/bin/python bench/ab_commits.py BASE_COMMIT [--rounds 3] [--out bench/results/FILE.json]

The base runs from a git worktree (/tmp/tessera-ab-BASE) with this venv's packages and its own
protobuf stubs; each round starts a fresh server, so neither side inherits the other's warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from result_file import save

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable


def worktree(commit: str) -> pathlib.Path:
    path = pathlib.Path(f"/tmp/tessera-ab-{commit[:12]}")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True)
    subprocess.run([PY, str(path / "proto" / "build.py")], check=True, stdout=subprocess.DEVNULL)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(tree: pathlib.Path, dtype: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree}/services:{tree}/kernels", TOKENIZERS_PARALLELISM="false")
    port, worker_port = free_port(), free_port()
    server = subprocess.Popen([PY, "-m", "tessera.cli", "serve", "--model", "smollm2", "--dtype", dtype,
                               "--port", str(port), "--worker-port", str(worker_port)], env=env, cwd=tree,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server from {tree} did not start")
                time.sleep(1)
        # one client for both sides: this tree's
        out = subprocess.run([PY, "-m", "tessera.cli", "bench", "serve", "--base-url", url, "--num-prompts", "64",
                              "--input-len", "128", "--output-len", "128", "--json"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True, text=True,
                          check=True).stdout.strip()
    trees = {"base": worktree(base), "this": ROOT}
    rows = []
    for r in range(args.rounds):
        for side, tree in trees.items():
            result = one_round(tree, args.dtype)
            row = {"round": r + 1, "side": side, "commit": base[:12] if side == "base" else "working tree",
                   "dtype": args.dtype, "output_tok_s": result["output_tok_s"],
                   "tpot_p50_ms": result["tpot_ms"]["p50"], "ttft_p50_ms": result["ttft_ms"]["p50"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    medians = {s: statistics.median(r["output_tok_s"] for r in rows if r["side"] == s) for s in trees}
    ratio = medians["this"] / medians["base"]
    print(f"median output tok/s: base {medians['base']:.1f}, this {medians['this']:.1f}: {ratio:.3f}x")
    save(args.out, "ab", f"Served throughput against {base[:12]}, {args.rounds} alternating rounds",
         rows, details={"median_ratio": round(ratio, 3), "base": base})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
