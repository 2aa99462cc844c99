"""Served load curve: output throughput, TPOT p50/p99 and TTFT p50 against concurrency, Tessera
and vLLM-CPU in the same run, in alternating rounds (round 1: tessera then vllm, round 2: vllm
then tessera, ...). Every point is `tessera bench serve` (random-token prompts, ignore_eos,
greedy) with at most C requests in flight: 2C prompts below C = 64 (so the point is a steady
state, not one wave), C prompts at and above it (all at once, as the headline's 64 x 128/128).
Each point draws new prompts (its own seed), so no point hits the prefix cache of another.

    .venv/bin/python bench/load_curve.py [--servers tessera,vllm] [--concurrency 1,4,16,64,128]
        [--rounds 3] [--tessera-dtype bfloat16] [--vllm-dtype bfloat16] [--tessera-args '--max-num-seqs 128']
        [--out bench/results/F.json]
    long prompts: --concurrency 16 --num-prompts 16 --input-len 2048 --output-len 16

Each server is started once per round and stopped after its points (one server at a time on the
machine). vLLM-CPU starts through ../shared/peers (install_vllm.sh, convert_gguf.py first; its
README). Prints one line per point and the medians; --out writes a `load` result file
(bench/render.py draws the curve).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from result_file import save

ROOT = pathlib.Path(__file__).resolve().parent.parent
PEERS_SCRIPTS = ROOT.parent / "shared" / "peers"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen | None, seconds: float = 900) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise SystemExit(f"the server at {url} did not start")
            time.sleep(2)


class Tessera:
    name = "tessera"

    def __init__(self, dtype: str, max_model_len: int, extra: str = ""):
        self.dtype, self.max_model_len, self.extra = dtype, max_model_len, shlex.split(extra)

    def start(self) -> str:
        port = free_port()
        self.proc = subprocess.Popen([PY, "-m", "tessera.cli", "serve", "--dtype", self.dtype, "--port", str(port),
                                      "--worker-port", str(free_port()), "--max-model-len", str(self.max_model_len),
                                      *self.extra],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_up(url, self.proc)
        return url

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(120)


class VLLM:
    """vLLM-CPU as ../shared/peers starts it: both cores, the GGUF converted to an HF directory."""
    name = "vllm-cpu"

    def __init__(self, dtype: str, max_model_len: int):
        self.dtype, self.max_model_len = dtype, max_model_len
        peers = os.environ.get("PEERS", f"{os.environ.get('TMPDIR', '/tmp')}/peers")
        self.model = f"{peers}/models/smollm2-135m-instruct" + ("-fp32" if dtype == "float32" else "")

    def _ctl(self, *args: str) -> None:
        script = (f"source {PEERS_SCRIPTS}/vllm_env.sh && bash {PEERS_SCRIPTS}/server_ctl.sh " + " ".join(args))
        subprocess.run(["bash", "-c", script], check=True, stdout=subprocess.DEVNULL)

    def start(self) -> str:
        port = free_port()
        self._ctl("start", "vllm", str(port), "--", "$VLLM", "serve", self.model, "--dtype", self.dtype,
                  "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(self.max_model_len),
                  "--served-model-name", "smollm2")
        url = f"http://127.0.0.1:{port}"
        wait_up(url, None)
        return url

    def stop(self) -> None:
        self._ctl("stop", "vllm")


def point(url: str, concurrency: int, seed: int, a: argparse.Namespace) -> dict:
    prompts = a.num_prompts or (2 * concurrency if concurrency < 64 else concurrency)
    out = subprocess.run([PY, "-m", "tessera.cli", "bench", "serve", "--base-url", url, "--num-prompts",
                          str(prompts if a.num_prompts else max(prompts, 8)), "--concurrency", str(concurrency),
                          "--input-len", str(a.input_len),
                          "--output-len", str(a.output_len), "--seed", str(seed), "--json"],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench serve against {url} at concurrency {concurrency} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="tessera,vllm")
    p.add_argument("--concurrency", default="1,4,16,64,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tessera-dtype", default="bfloat16")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--tessera-args", default="", help="more `tessera serve` flags, e.g. '--max-num-seqs 128'")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="prompts at every point (default: see above)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    fit = a.input_len + a.output_len + 16
    kinds = {"tessera": Tessera(a.tessera_dtype, max(fit, 1024), a.tessera_args), "vllm": VLLM(a.vllm_dtype, max(fit, 1024))}
    servers = [kinds[s] for s in a.servers.split(",")]
    levels = [int(c) for c in a.concurrency.split(",")]
    rows = []
    for r in range(a.rounds):
        for server in servers if r % 2 == 0 else servers[::-1]:
            url = server.start()
            try:
                for c in levels:
                    res = point(url, c, seed=1000 * (r + 1) + c, a=a)
                    row = {"round": r + 1, "round_utc": time.strftime("%H:%M:%S", time.gmtime()),
                           "server": server.name, "dtype": server.dtype, "concurrency": c,
                           **({"server_args": a.tessera_args} if server.name == "tessera" and a.tessera_args else {}),
                           "num_prompts": res["num_prompts"], "input_len": a.input_len, "output_len": a.output_len,
                           "output_tok_s": res["output_tok_s"], "tpot_p50_ms": res["tpot_ms"]["p50"],
                           "tpot_p99_ms": res["tpot_ms"]["p99"], "ttft_p50_ms": res["ttft_ms"]["p50"],
                           "ttft_p99_ms": res["ttft_ms"]["p99"], "failed": res["failed"]}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                server.stop()
    summary = medians(rows)
    for line in summary:
        print(json.dumps(line))
    names = " and ".join(f"{s.name} ({s.dtype})" for s in servers)
    save(a.out, "load", f"Load curve {a.input_len}/{a.output_len}: {names}, {a.rounds} alternating rounds", rows,
         details={"medians": summary})
    return 0


def medians(rows: list[dict]) -> list[dict]:
    """Per server and concurrency, the median of each measure over the rounds; with vLLM-CPU in
    the run, Tessera's throughput ratio and TPOT/TTFT against it."""
    out = []
    for server, c in dict.fromkeys((r["server"], r["concurrency"]) for r in rows):
        mine = [r for r in rows if r["server"] == server and r["concurrency"] == c]
        out.append({"server": server, "concurrency": c, "rounds": len(mine),
                    **{k: round(statistics.median(r[k] for r in mine), 1)
                       for k in ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms")}})
    by = {(m["server"], m["concurrency"]): m for m in out}
    for m in out:
        ref = by.get(("vllm-cpu", m["concurrency"]))
        if m["server"] == "tessera" and ref:
            m["throughput_vs_vllm"] = round(m["output_tok_s"] / ref["output_tok_s"], 2)
            m["tpot_p50_vs_vllm"] = round(m["tpot_p50_ms"] / ref["tpot_p50_ms"], 2)
            m["ttft_p50_vs_vllm"] = round(m["ttft_p50_ms"] / ref["ttft_p50_ms"], 2)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
