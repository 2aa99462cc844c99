"""`python -m tessera.entrypoints.vllm_main worker --engine vllm ...`: what `tessera worker
--engine vllm` re-executes itself as (vllm_worker.py). Being the main module, this file is also
imported (as __mp_main__) by every process vLLM spawns with multiprocessing (its engine core,
and that one's worker); there it asks the kernel to send SIGTERM (vLLM's clean shutdown) when
the parent dies, so a SIGKILLed worker leaves no engine process behind."""
from __future__ import annotations

import sys


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG


if __name__ == "__mp_main__":
    die_with_parent()
elif __name__ == "__main__":
    from tessera.cli import main
    sys.exit(main())
