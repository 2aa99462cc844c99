"""Paged decode attention for the CPU: a torch reference and a C kernel (csrc/) that reads
K/V straight from the paged cache instead of gathering them first.

The C source is compiled on first use with the host's C compiler (-O3 -march=native -fopenmp)
into a cache directory and loaded with ctypes (which releases the GIL during the call).
If no compiler is available the caller falls back to the reference.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import threading

import torch

_SRC = pathlib.Path(__file__).parent / "csrc" / "paged_decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               block_size: int, scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [KV, S, D]; block_tables [B, W]; context_lens [B] -> [B, H, D]."""
    B, H, D = q.shape
    KV = k_cache.shape[0]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(context_lens[b])
        t = torch.arange(L)
        slots = block_tables[b, t // block_size] * block_size + t % block_size
        k = k_cache[:, slots].repeat_interleave(H // KV, dim=0)       # [H, L, D]
        v = v_cache[:, slots].repeat_interleave(H // KV, dim=0)
        p = torch.softmax((q[b].unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out[b] = (p.unsqueeze(1) @ v).squeeze(1)
    return out


def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source/flags/CPU; None when it cannot be built."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed:
            return _lib
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            _failed = True
            return None
        key = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode() + _cpu_id()).hexdigest()[:16]
        cache = pathlib.Path(os.environ.get("TESSERA_CACHE", pathlib.Path.home() / ".cache" / "tessera"))
        so = cache / "kernels" / f"paged_decode_attention-{key}.so"
        try:
            if not so.exists():
                so.parent.mkdir(parents=True, exist_ok=True)
                tmp = so.with_suffix(f".{os.getpid()}.tmp")
                subprocess.run([cc, *_FLAGS, str(_SRC), "-o", str(tmp), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(tmp, so)
            lib = ctypes.CDLL(str(so))
        except (OSError, subprocess.SubprocessError):
            _failed = True
            return None
        fn = lib.paged_decode_attention_f32
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        _lib = lib
        return _lib


def _cpu_id() -> bytes:
    try:
        return pathlib.Path("/proc/cpuinfo").read_bytes().split(b"\n\n")[0]
    except OSError:
        return b""


def available() -> bool:
    """True when the C kernel is built (TESSERA_DISABLE_CPU_KERNELS=1 turns it off)."""
    return os.environ.get("TESSERA_DISABLE_CPU_KERNELS") != "1" and _library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int, scale: float) -> torch.Tensor:
    """The C kernel; same contract as paged_decode_attention_ref."""
    B, H, D = q.shape
    KV, S, Dk = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32, "float32 only"
    assert Dk == D and v_cache.shape == k_cache.shape and H % KV == 0 and H // KV <= 64
    assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.shape[0] == B
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    lib = _library()
    assert lib is not None, "kernel unavailable: use paged_decode_attention_ref"
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q)
    lib.paged_decode_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
                                   B, H, KV, D, block_tables.shape[1], block_size, S, scale,
                                   torch.get_num_threads())
    return out
