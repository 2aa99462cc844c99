"""What mutual TLS on the gateway -> worker link costs in served throughput: the same worker
and gateway (SmolLM2, --dtype DTYPE) started as `tessera serve` starts them, once with each
holding a certificate of a throwaway CA and once in plaintext on loopback, alternating, each
round a fresh pair of processes; `tessera bench serve` with 64 prompts x 128/128 at once and 8
one at a time. Prints one line per run and writes bench/results/tls_cost.json.

    python bench/tls_cost.py [ROUNDS] [DTYPE]
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESSERA = [sys.executable, "-m", "tessera.cli"]
GATEWAY, WORKER = 18700, 18751


def _cpu() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


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
    result = {"what": "served throughput, gateway -> worker over mutual TLS vs plaintext (loopback)",
              "command": f"python bench/tls_cost.py {rounds} {dtype}", "cpu": _cpu(), "dtype": dtype,
              "model": "SmolLM2-135M-Instruct", "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "median_output_tok_s": med, "tls_over_plaintext": round(med["tls"] / med["plaintext"], 3)}
    out = ROOT / "bench" / "results" / "tls_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median output tok/s: plaintext {med['plaintext']:.1f}, tls {med['tls']:.1f} "
          f"(ratio {result['tls_over_plaintext']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
