"""Tensors on 2 MiB pages, where Linux allows it (transparent huge pages in "madvise" mode,
the default on the machines here).

Decode reads every weight once per token and the KV cache in 2 KiB pieces scattered over all
of it; with 4 KiB pages the TLB misses on most of those reads, and the CPU's memory-level
parallelism goes to page walks. Both the KV cache (the attention kernel's step) and the weights
(the decode GEMVs, which then come closer to a plain read's bandwidth) gain; the numbers are in
docs/performance-notes.md. The weights must share one mapping: a linear is a few MB, and a 2 MiB
page only forms where an aligned 2 MiB range lies inside one allocation.
TESSERA_DISABLE_HUGE_PAGES=1 leaves every tensor on ordinary pages (to compare the two).
"""
from __future__ import annotations

import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64          # each tensor in a slab starts on a cache line
_MIN_BYTES = 64 << 10  # smaller tensors (norm weights, biases) stay where they are


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros on 2 MiB pages. The memory is a fresh anonymous mapping (malloc may hand back
    pages already touched, which stay small), advised before its first touch, the tensor
    starting on a 2 MiB boundary; every page is touched here, not during the first requests."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE or os.environ.get("TESSERA_DISABLE_HUGE_PAGES") == "1":
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    skip = -start % HUGE_PAGE
    t = torch.frombuffer(region, dtype=dtype, count=count, offset=skip).view(shape)
    return t.zero_()


def move_weights(model: nn.Module) -> int:
    """Copy the model's large CPU parameters and buffers into one slab on 2 MiB pages, each
    tensor keeping its Parameter object (tied weights stay tied) and its values; return the
    bytes moved. Modules that derive state from their buffers (a packed int4 weight) rebuild
    it. Other views of the old tensors (none in our models) would keep the old memory."""
    slots: dict[tuple, list[tuple[nn.Module, str, bool]]] = {}
    tensors: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if (t is None or t.device.type != "cpu" or not t.is_contiguous()
                        or t.numel() * t.element_size() < _MIN_BYTES):
                    continue
                key = (t.data_ptr(), t.dtype, tuple(t.shape))   # the same tensor, held twice when tied
                tensors.setdefault(key, t)
                slots.setdefault(key, []).append((module, name, is_param))
    offsets, total = {}, 0
    for key, t in tensors.items():
        offsets[key] = total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total < HUGE_PAGE or os.environ.get("TESSERA_DISABLE_HUGE_PAGES") == "1":
        return 0
    slab = zeros((total,), torch.uint8)
    touched = set()
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        view = slab[offsets[key]:offsets[key] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        for module, name, is_param in slots[key]:
            if is_param:
                module._parameters[name].data = view
            else:
                module._buffers[name] = view
            touched.add(module)
    for module in touched:
        refresh = getattr(module, "_formatted", None)
        if refresh is not None:
            refresh()
    return total
