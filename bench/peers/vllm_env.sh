# Environment for vLLM-CPU's server on this machine; source it (bench/peers/vllm_serve.sh does).
# Defines VLLM, the command line to run (the venv's python and vllm_cli.py).
#   VLLM_VENV                   vLLM's environment (default: .venv-vllm in the repository)
#   VLLM_CPU_OMP_THREADS_BIND   CPUs for vLLM's OpenMP threads (default: every CPU this shell may
#                               use; vLLM's own default leaves one free, which on a 2-core
#                               machine halves its compute)
#   VLLM_CPU_KVCACHE_SPACE      GiB of KV cache (default 2)
#   NO_PRELOAD=1                do not preload tcmalloc and Intel OpenMP
_peers_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_repo=$(cd "$_peers_dir/../.." && pwd)
VLLM_VENV=${VLLM_VENV:-$_repo/.venv-vllm}
export HF_HUB_OFFLINE=1                         # the weights are local: never ask the Hub
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}  # vLLM's internal traffic stays on loopback
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-${TESSERA_CACHE:-$HOME/.cache/tessera}/peers/vllm}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
if [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
  # e.g. "0-1": runs of consecutive CPUs as ranges, as libnuma's CPU lists write them
  VLLM_CPU_OMP_THREADS_BIND=$(python3 -c '
import os
runs = []
for c in sorted(os.sched_getaffinity(0)):
    if runs and c == runs[-1][1] + 1:
        runs[-1][1] = c
    else:
        runs.append([c, c])
print(",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs))')
  export VLLM_CPU_OMP_THREADS_BIND
fi
# vLLM's CPU worker asks for tcmalloc and Intel's OpenMP (libiomp5, from the intel-openmp wheel)
# to be preloaded; it runs without them, more slowly.
_tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ -z "${NO_PRELOAD:-}" ] && [ -f "$_tcmalloc" ] && [ -f "$VLLM_VENV/lib/libiomp5.so" ]; then
  export LD_PRELOAD="$_tcmalloc:$VLLM_VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
VLLM="$VLLM_VENV/bin/python $_peers_dir/vllm_cli.py"
unset _peers_dir _repo _tcmalloc
