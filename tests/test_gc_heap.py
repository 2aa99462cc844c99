"""The serving processes freeze their start-up heap (gc_heap.py): a full collection then walks
only what came after, and garbage made after the freeze is still collected."""
from __future__ import annotations

import gc
import weakref

from tessera.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self          # a reference cycle: only the cyclic collector frees it


def test_a_frozen_start_up_heap_leaves_full_collections_to_what_came_later():
    startup = [_Node() for _ in range(20_000)]
    walked_before = len(gc.get_objects(generation=2)) + len(gc.get_objects(generation=1))
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() >= len(startup)
        assert len(gc.get_objects(generation=2)) + len(gc.get_objects(generation=1)) < walked_before - len(startup)
        later = _Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None    # a cycle made after the freeze is collected as before
    finally:
        gc.unfreeze()            # this test process goes on (pytest's own objects)
