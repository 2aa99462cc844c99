#!/usr/bin/env bash
# CPU seconds per process and thread of `tessera serve` (bf16) during one 64 x 128/128
# `tessera bench serve` run (CONCURRENCY=1: 8 prompts one at a time), and the run's
# throughput: where the cores go besides the engine. OUT=FILE also writes the run as a `served`
# result file (tessera.bench.results) with the CPU seconds per thread in its details.
#   bash bench/served_cpu.sh            (needs `make setup-dev`; port 8100 free)
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tessera
WORK=${WORK:-/tmp/served_cpu}
mkdir -p "$WORK"
result=()
if [ -n "${OUT:-}" ]; then result=(--out "$OUT" --server tessera --server-dtype bfloat16); fi
setsid $T serve --dtype bfloat16 --port 8100 > "$WORK/serve.log" 2>&1 & pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf --noproxy '*' http://127.0.0.1:8100/v1/models > /dev/null && break; sleep 1; done
$T bench serve --base-url http://127.0.0.1:8100 --num-prompts 8 --input-len 128 --output-len 16 --seed 7 > /dev/null 2>&1
tree() { local p c; for p in "$@"; do echo "$p"; for c in $(cat /proc/"$p"/task/*/children 2>/dev/null); do tree "$c"; done; done; }
snap() {   # pid comm-tid ticks, for every thread of the server's processes
  for p in $(tree $pid); do for t in /proc/"$p"/task/*; do
    echo "$p $(tr ' ' _ < "$t"/comm)-${t##*/} $(awk '{print $14 + $15}' "$t"/stat)"; done; done
}
snap > "$WORK/before"
if [ "${CONCURRENCY:-}" = 1 ]; then prompts=(--num-prompts 8 --concurrency 1 --seed 1); else prompts=(--num-prompts 64); fi
$T bench serve --base-url http://127.0.0.1:8100 "${prompts[@]}" --input-len 128 --output-len 128 --json \
  ${result[@]+"${result[@]}"} > "$WORK/run.json" 2> /dev/null
snap > "$WORK/after"
python3 - "$WORK" "${OUT:-}" <<'PY'
import json, sys
out, result = sys.argv[1], sys.argv[2]
def ticks(name):
    return {(p, t): int(n) for p, t, n in (line.split() for line in open(f"{out}/{name}"))}
before, after = ticks("before"), ticks("after")
used = sorted(((n - before.get(k, 0)) / 100, k) for k, n in after.items())[::-1]
for seconds, (p, thread) in used:
    if seconds >= 0.05:
        print(f"pid {p} thread {thread}: {seconds:.2f} s")
r = json.load(open(f"{out}/run.json"))
print(f"{r['output_tok_s']} output tok/s, TTFT p50 {r['ttft_ms']['p50']} ms, TPOT p50 {r['tpot_ms']['p50']} ms")
if result:
    doc = json.load(open(result))
    doc.setdefault("details", {})["cpu_seconds_by_thread"] = {
        f"{p}/{thread}": round(seconds, 2) for seconds, (p, thread) in used if seconds >= 0.05}
    doc["details"]["script"] = "bash bench/served_cpu.sh"
    open(result, "w").write(json.dumps(doc, indent=1) + "\n")
PY
