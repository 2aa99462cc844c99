"""What mutual TLS on the gateway -> worker link costs in served throughput: the same worker
and gateway (SmolLM2, --dtype DTYPE) started as `tessera serve` starts them, once with each
holding a certificate of a throwaway CA and once in plaintext on loopback, alternating, each
round a fresh pair of processes; `tessera bench serve` with 64 prompts x 128/128 at once and 8
one at a time. Prints one line per run and writes a `tls` result file (--out FILE; by default
bench/results/tls-<cpu kind>-<date>.json).

    python bench/tls_cost.py [ROUNDS] [DTYPE] [--out FILE]
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path
from tessera.bench import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESSERA = [sys.executable, "-m", "tessera.cli"]
GATEWAY, WORKER = 18700, 18751


def _stack(tls: dict | None, dtype: str) -> list[subprocess.Popen]:
    procs = []
    for role, argv in (("worker", ["worker", "--host", "127.0.0.1", "--port", str(WORKER), "--dtype", dtype]),
                       ("gateway", ["gateway", "--port", str(GATEWAY), "--worker", f"127.0.0.1:{WORKER}"])):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        env.pop("TESSERA_TLS_DIR", None)
        if tls:
            env["TESSERA_TLS_DIR"] = str(tls[role])
        procs.append(subprocess.Popen([*TESSERA, *argv], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{GATEWAY}/health/ready", timeout=5).status_code == 200:
                return procs
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the stack never became ready")


def _bench(*args: str) -> dict:
    out = subprocess.run([*TESSERA, "bench", "serve", "--base-url", f"http://127.0.0.1:{GATEWAY}", "--input-len",
                          "128", "--output-len", "128", "--json", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    kind = machine.machine(bandwidth=False)["kind"]
    out = pop_out() or str(ROOT / "bench" / "results" / f"tls-{kind}-{time.strftime('%Y-%m-%d')}.json")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    from tessera.mtls.certs import write_role_dirs
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tls = write_role_dirs(scratch, "bench", ("worker", "gateway"))
        for r in range(rounds):
            for mode in ("plaintext", "tls"):
                procs = _stack(tls if mode == "tls" else None, dtype)
                try:
                    many = _bench("--num-prompts", "64", "--seed", str(r))
                    one = _bench("--num-prompts", "8", "--concurrency", "1", "--seed", str(100 + r))
                finally:
                    for p in procs:
                        p.terminate()
                    for p in procs:
                        p.wait(timeout=60)
                row = {"round": r, "mode": mode, "output_tok_s": many["output_tok_s"],
                       "ttft_p50_ms_64": many["ttft_ms"]["p50"], "ttft_p50_ms_c1": one["ttft_ms"]["p50"],
                       "tpot_p50_ms_c1": one["tpot_ms"]["p50"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    med = {m: statistics.median(r["output_tok_s"] for r in rows if r["mode"] == m) for m in ("plaintext", "tls")}
    ratio = round(med["tls"] / med["plaintext"], 3)
    save(out, "tls", f"served throughput, gateway -> worker over mutual TLS against plaintext (loopback), "
         f"SmolLM2-135M-Instruct {dtype}", [{**r, "dtype": dtype} for r in rows],
         details={"median_output_tok_s": med, "tls_over_plaintext": ratio},
         notes="64 prompts x 128/128 at once (output_tok_s, ttft_p50_ms_64) and 8 one at a time (_c1)")
    print(f"median output tok/s: plaintext {med['plaintext']:.1f}, tls {med['tls']:.1f} (ratio {ratio})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
