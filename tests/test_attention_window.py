"""Sliding windows, soft-capping and a family's query scale in paged attention
(layers/attention.paged_attention), on every path a step takes: decode rows, fresh prompts,
a chunk after cached tokens, a draft tree (its rows on the kernel, or its explicit mask), the C
kernel and the torch paths, against a dense float64 softmax written here. Also run under the
AVX2 build of the kernel."""
from __future__ import annotations

import pytest
import torch

from tessera.batch import build_forward_batch
from tessera.layers import attention
from tessera.scheduler import ScheduledRequest, StepPlan
from tessera.spec.tree import lineage
from tessera_kernels import cbuild, paged_attention_cpu as pa

pytestmark = pytest.mark.kernels

BS, KV, H, D, SCALE = 4, 2, 6, 64, 0.37     # blocks of 4: windows of 3 and 10 align to none


def _reference(q, keys, values, kpos, qpos, scale, window, softcap):
    """q [H, D]; keys, values [L, KV, D] at positions kpos [L]: the query at qpos over them,
    within the window, in float64."""
    keep = kpos <= qpos
    if window:
        keep &= qpos - kpos < window
    k = keys[keep].double().repeat_interleave(H // KV, dim=1)      # [L', H, D]
    v = values[keep].double().repeat_interleave(H // KV, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)


class Step:
    """A step of several requests over one paged cache, with what each token may see."""

    def __init__(self, dtype, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.k_cache = torch.zeros(KV, 96 * BS, D, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.free = iter(torch.randperm(96, generator=self.g).tolist())
        self.entries, self.q, self.k, self.v, self.sees = [], [], [], [], []

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dtype)

    def request(self, cached: int, new: int, parents: tuple[int, ...] = ()) -> None:
        """`cached` tokens already in the cache, `new` computed now (a draft tree under the
        first of them when `parents`, else positions in order)."""
        table = tuple(next(self.free) for _ in range(-(-(cached + new) // BS)))
        kc, vc = self._rand(cached, KV, D), self._rand(cached, KV, D)
        slots = [table[p // BS] * BS + p % BS for p in range(cached)]
        self.k_cache[:, slots], self.v_cache[:, slots] = kc.transpose(0, 1), vc.transpose(0, 1)
        kn, vn = self._rand(new, KV, D), self._rand(new, KV, D)
        full = (-1,) + parents
        for i in range(new):
            line = sorted(lineage(full, i)) if parents else list(range(i + 1))
            pos = torch.cat([torch.arange(cached), cached + torch.tensor([len(lineage(full, a)) - 1 if parents else a
                                                                         for a in line])])
            self.sees.append((torch.cat([kc, kn[line]]), torch.cat([vc, vn[line]]), pos, int(pos[-1])))
        self.entries.append(ScheduledRequest(str(len(self.entries)), tuple(range(new)), cached, table, True, parents))
        self.q.append(self._rand(new, H, D))
        self.k.append(kn)
        self.v.append(vn)

    def run(self, window, softcap, explicit_masks=False):
        batch = build_forward_batch(StepPlan(tuple(self.entries)), BS)
        masks = [c.mask for c in batch.prefills] if explicit_masks else None
        q, k, v = torch.cat(self.q), torch.cat(self.k), torch.cat(self.v)
        out = attention.paged_attention(q, k, v, self.k_cache, self.v_cache, batch, SCALE, masks,
                                        window=window, softcap=softcap)
        ref = torch.stack([_reference(q[t], *self.sees[t], SCALE, window, softcap) for t in range(len(self.sees))])
        return out, ref


def _mixed_step(dtype) -> Step:
    step = Step(dtype)
    step.request(60, 1)        # decode rows: a long context (whole blocks skipped) and a short one
    step.request(6, 1)
    step.request(0, 21)        # fresh prompts (the kernel's prompt tiles; SDPA's batch of equal ones)
    step.request(0, 21)
    step.request(17, 9)        # a chunk after earlier chunks
    step.request(19, 6, parents=(0, 0, 1, 2, 3))    # a draft tree after its root
    return step


def _assert_close(out, ref, dtype, v_max):
    err = (out.double() - ref).abs()
    if dtype == torch.float32:
        assert err.max() <= 2e-5, float(err.max())
    else:   # half a bf16 ulp of the result, and two probabilities rounded the other way (test_attention_kernel)
        assert (err <= ref.abs() * 2.0 ** -8 + 2 * 2.0 ** -7 * v_max + 1e-5).all(), float(err.max())


WINDOWS = [(0, 0.0), (3, 0.0), (10, 0.0), (100, 0.0), (0, 5.0), (10, 5.0), (7, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_every_path_keeps_the_window_and_the_cap(dtype, path, window, softcap, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(attention, "_kernel_applies", lambda q: False)
    elif not pa.available():
        pytest.skip("no C compiler for the CPU kernel")
    step = _mixed_step(dtype)
    out, ref = step.run(window, softcap)
    _assert_close(out, ref, dtype, max(step.v_cache.abs().max(), torch.cat(step.v).abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window,softcap", [(3, 0.0), (10, 5.0), (0, 5.0)])
def test_explicit_masks_combine_with_the_window(dtype, window, softcap):
    """Masks passed in (tree verification's, every chunk's own here) take the torch path: the
    window narrows each mask row to its last keys."""
    step = _mixed_step(dtype)
    out, ref = step.run(window, softcap, explicit_masks=True)
    _assert_close(out, ref, dtype, max(step.v_cache.abs().max(), torch.cat(step.v).abs().max()))


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 3.0), (13, 4.0), (1000, 0.0)])
def test_kernel_matches_its_reference(dtype, window, softcap):
    """The C kernel against paged_decode_attention_ref (rows of any context, windows across
    block edges), the scale as given."""
    g = torch.Generator().manual_seed(window + int(softcap))
    k_cache = torch.randn(KV, 112 * BS, D, generator=g).to(dtype)
    v_cache = torch.randn(KV, 112 * BS, D, generator=g).to(dtype)
    lens = torch.tensor([1, 4, 5, 13, 18, 33, 61])
    tables = torch.randperm(112, generator=g).view(7, 16)
    q = torch.randn(7, H, D, generator=g).to(dtype)
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, BS, SCALE, window, softcap)
    ref = pa.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, BS, SCALE,
                                        window=window, softcap=softcap)
    _assert_close(out, ref, dtype, v_cache.abs().max())


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.skipif("avx512f" not in cbuild.cpu_flags(),
                    reason="this CPU has no AVX-512: its own build is the AVX2 one, which the tests above ran")
def test_the_avx2_build_keeps_the_window_and_the_cap(tmp_path):
    """This file's kernel tests again with the kernel built for AVX2 (TESSERA_MARCH=haswell, its
    own cache), as test_kernels.py rebuilds the kernels (the torch paths do not change)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TESSERA_MARCH": "haswell", "TESSERA_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "(-kernel- or reference or replayed) and not avx2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert list((tmp_path / "kernels").glob("paged_decode_attention-*.so"))


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
def test_a_replayed_step_keeps_the_window_and_the_cap():
    """A step recorded (step_graph.py replays decode and prompt rows this way) and made again on
    new queries: the kernel call carries the window and the cap, so the replay is the new step's
    attention, not the recorded one's."""
    from tessera_kernels import replay
    step = Step(torch.float32, seed=3)
    step.request(45, 1)
    step.request(7, 1)
    step.request(0, 9)
    batch = build_forward_batch(StepPlan(tuple(step.entries)), BS)
    q, k, v = torch.cat(step.q), torch.cat(step.k), torch.cat(step.v)
    with replay.record() as rec:
        out = attention.paged_attention(q, k, v, step.k_cache, step.v_cache, batch, SCALE, window=6, softcap=3.0)
    assert rec.refused is None and rec.calls
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(4)))
    rec.replay()
    ref = torch.stack([_reference(q[t], *step.sees[t], SCALE, 6, 3.0) for t in range(len(step.sees))])
    _assert_close(out, ref, torch.float32, 0)
