"""Weights moved onto one slab of 2 MiB pages at load (huge_pages.move_weights): the same
tokens, tied weights still tied, derived kernel state pointing at the moved memory, and the
slab really on huge pages where the kernel allows them."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tessera import huge_pages
from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.layers.quant import Int4Linear
from tessera.models import loader

PROMPT = [1, 504, 3458, 282, 4649, 314, 2897, 30]


def _big_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if t.numel() * t.element_size() >= 64 << 10 and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def _thp_mode() -> str:
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_moved_weights_give_the_same_tokens(monkeypatch, quantization):
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    move = huge_pages.move_weights
    monkeypatch.setattr(loader.huge_pages, "move_weights", lambda model: 0)   # loaded where malloc put it
    where = Engine(EngineConfig(model="smollm2", dtype="bfloat16", quantization=quantization, num_threads=2))
    before = where.generate([PROMPT], sampling)
    model = where.runner.model
    moved = move(model)

    big = _big_tensors(model)
    span = max(t.data_ptr() + t.numel() * t.element_size() for t in big) - min(t.data_ptr() for t in big)
    assert moved >= sum(t.numel() * t.element_size() for t in big) and span <= moved   # one slab
    assert model.lm_head.weight is model.embed_tokens.weight                               # still tied
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == (120 if quantization else 0)
    assert all(m._q4.packed.data_ptr() == m.packed.data_ptr() for m in int4)              # kernel state follows
    assert where.generate([PROMPT], sampling) == before


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_the_slab_is_on_huge_pages():
    t = huge_pages.zeros((8 << 20,), torch.uint8)     # 8 MiB
    start, inside = t.data_ptr(), False
    for line in pathlib.Path("/proc/self/smaps").read_text().split("\n"):
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            inside = lo <= start < hi
        elif inside and fields and fields[0] == "AnonHugePages:":
            assert int(fields[1]) >= 2048, f"no 2 MiB page in the slab's mapping ({line.strip()})"
            return
    pytest.fail("the slab's mapping was not found in /proc/self/smaps")
