"""The start-up heap of a serving process, left out of Python's garbage collection.

A full (oldest-generation) collection walks every object the process tracks, with the GIL
held: the engine thread between its kernels, the gRPC loop and the gateway's event loop all
stop. A worker with SmolLM2 loaded and warmed tracks hundreds of thousands of objects (torch's
modules, the tokenizer's vocabulary, the engine), so one full collection is a pause as long as
several decode steps in which every request in flight stands still, and under load a worker runs
one every minute or so. Frozen once start-up is done (as vLLM's engine core does after its
warm-up), those objects are out of the collector's sight; what is made later is collected as
before.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then freeze every tracked object that remains."""
    gc.collect()
    gc.freeze()
