"""The serving processes freeze their start-up heap (gc_heap.py): what start-up left as
garbage is collected first, what remains is out of the collector's sight, and garbage made
after the freeze is still collected."""
from __future__ import annotations

import gc
import weakref

from tessera.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self          # a reference cycle: only the cyclic collector frees it


def test_a_frozen_start_up_heap_leaves_the_collector_what_comes_later():
    startup = [_Node() for _ in range(1000)]
    garbage = _Node()
    collected_first = weakref.ref(garbage)
    del garbage
    freeze_startup_heap()
    try:
        assert collected_first() is None            # start-up's garbage is not frozen with the rest
        assert gc.get_freeze_count() >= len(startup)
        assert all(gc.is_tracked(n) for n in startup[:10])
        walked = {id(o) for o in gc.get_objects()}    # what a full collection would walk
        assert not any(id(n) in walked for n in startup)
        later = _Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None                       # a cycle made after the freeze is collected
    finally:
        gc.unfreeze()                               # this test process goes on (pytest's own objects)
