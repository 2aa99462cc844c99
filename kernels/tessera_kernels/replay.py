"""Record the C kernel calls that a piece of code makes, and make them again: the CPU's
counterpart of a CUDA graph.

A decode step at batch 1 is ~360 C calls (norms, GEMVs, RoPE, KV writes, attention) with
Python between them, and for a small model that Python is a large share of the step. Every
call's arguments are pointers, sizes and scalars, so
when the next step has the same shapes and its inputs sit in the same buffers, the same calls
with the same arguments compute it. `record()` notes each call made through a library that
cbuild loaded (in this thread) and keeps every tensor allocated meanwhile alive, so that the
pointers stay the recording's own; `Recording.replay()` makes the calls again. Recordings of
which only one runs at a time may take their buffers from one shared Pool (as CUDA graphs share
a memory pool): the memory is then the largest recording's, not their sum.

`replay()` makes the calls from one C loop (csrc/replay_calls.c, one ctypes call for the whole
recording) where the platform's calling convention lets one prototype call every kernel: each
call from Python costs its argument conversions, a Python frame and a release and retake of
the GIL, which adds up over a step's calls (TESSERA_REPLAY_IN_PYTHON=1 keeps the loop in Python,
to compare the two).

What is recorded must be all there is: a torch op that computes (anything but a view or an
allocation) while recording would not be made again, so the recording refuses it and says which
(`Recording.refused`); the caller then keeps running that code as it is. What reaches memory
without a torch op (torch.from_numpy, ctypes buffers) the guard cannot see: code that is
recorded must not pass such memory to a kernel.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import platform
import sys
import threading
from typing import Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_local = threading.local()   # .recording: the Recording this thread is making, if any
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[ctypes._CFuncPtr, tuple, object]] = []   # function, arguments, what it returned
        self.tensors: list[torch.Tensor] = []   # every buffer the calls point into that was made while recording
        self.refused: str | None = None         # the first computing torch op met, by name
        self._plan: ctypes.Array | None = None  # the calls for the C loop (csrc/replay_calls.c), made on first replay
        self._planned = False

    def replay(self) -> None:
        """Make every recorded call again, in order. A call that returns other than it did when
        recorded (a kernel's status: a bad slot, no memory) raises: its wrapper would have."""
        if self.refused is not None:
            raise RuntimeError(f"this recording ran a torch op ({self.refused}) it cannot replay")
        if not self._planned:
            self._plan, self._planned = _plan(self.calls), True
        if self._plan is not None:
            got = ctypes.c_int32()
            failed = _executor()[0].replay_calls(self._plan, len(self._plan), ctypes.byref(got))
            if failed >= 0:
                fn, _, result = self.calls[failed]
                raise RuntimeError(f"{fn.__name__} returned {got.value} on replay, {result} when recorded")
            return
        for fn, args, result in self.calls:
            got = fn(*args)
            if got != result:
                raise RuntimeError(f"{fn.__name__} returned {got} on replay, {result} when recorded")


_INTS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


@functools.cache
def _executor() -> tuple[ctypes.CDLL, type] | None:
    """The C loop that makes a recording's calls (csrc/replay_calls.c) and its call record,
    where the calling convention it relies on holds (x86-64 Linux) and it builds;
    TESSERA_REPLAY_IN_PYTHON=1 keeps the loop in Python (to compare the two)."""
    if (platform.machine() != "x86_64" or sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8
            or os.environ.get("TESSERA_REPLAY_IN_PYTHON") == "1"):
        return None
    from tessera_kernels import cbuild     # cbuild loads every library through this module
    built = cbuild.load("replay_calls")
    if built is None:
        return None
    lib = ctypes.CDLL(built._name)          # a plain handle: the loop itself is never recorded
    lib.replay_calls.restype = ctypes.c_int64
    lib.replay_calls.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

    class Call(ctypes.Structure):
        _fields_ = [("fn", ctypes.c_void_p), ("ints", ctypes.c_int64 * lib.replay_calls_max_ints()),
                    ("floats", ctypes.c_float * lib.replay_calls_max_floats()),
                    ("expect", ctypes.c_int32), ("check", ctypes.c_int32)]
    return lib, Call


def _plan(calls: list[tuple[ctypes._CFuncPtr, tuple, object]]) -> ctypes.Array | None:
    """The calls as the C loop's records, or None (replay them from Python) where there is no
    C loop or a function's declared types are not all pointers, integers and floats (with an
    int or no result, and no errcheck), its arguments not plain ints and floats, or more than
    the loop's registers and slots. The plan is made once: calls edited afterwards are not
    seen (nothing edits them; a test that does makes the plan again)."""
    executor = _executor()
    if executor is None or not calls:
        return None
    lib, Call = executor
    plan = (Call * len(calls))()
    for record, (fn, args, result) in zip(plan, calls):
        types = fn.argtypes
        if (types is None or len(types) != len(args) or fn.restype not in (None, ctypes.c_int)
                or getattr(fn, "errcheck", None) is not None):
            return None
        ints = [a or 0 for t, a in zip(types, args) if t in _INTS]
        floats = [a for t, a in zip(types, args) if t is ctypes.c_float]
        if (len(ints) + len(floats) != len(args) or len(ints) > len(record.ints)
                or len(floats) > len(record.floats) or not all(type(a) is int for a in ints)
                or not all(isinstance(a, (int, float)) for a in floats)):
            return None
        record.fn = ctypes.cast(fn, ctypes.c_void_p).value
        record.ints[:len(ints)] = ints
        record.floats[:len(floats)] = floats
        record.check = fn.restype is ctypes.c_int
        record.expect = result if record.check else 0
    return plan


class Pool:
    """One block of memory that recordings allocate their contiguous buffers from, each from
    its start: for recordings of which only one is made or replayed at a time. A recording that
    needed more than the pool holds took the rest from torch (`overflowed`); `grow` then makes
    room for the next, and the recordings made from the old block must be made again (each
    holds the block it was made from, so theirs stays valid until they go)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.used = 0   # bytes the current (or last) recording has taken

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // 64) * 64                   # each buffer on its own cache lines
        self.used = start + nbytes
        if self.used > self.buffer.numel():
            return None
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    @property
    def overflowed(self) -> bool:
        """Whether the last recording needed more than the pool holds."""
        return self.used > self.buffer.numel()

    def grow(self, expected: int = 0) -> None:
        """Room for the last recording, for `expected` bytes (what the caller foresees its largest
        recording taking), and at least twice as much as before."""
        self.buffer = torch.empty(max(self.used, expected, 2 * self.buffer.numel()), dtype=torch.uint8)


class _Guard(TorchDispatchMode):
    """Keeps the tensors allocated while recording (from the pool where one is given), and
    notes the first op that computes."""

    def __init__(self, recording: Recording, pool: Pool | None) -> None:
        super().__init__()
        self.recording, self.pool = recording, pool

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_local, "recording", None) is not self.recording:   # paused()
            return func(*args, **kwargs)
        if (func is torch.ops.aten.empty.memory_format and self.pool is not None
                and kwargs.get("memory_format") in (None, torch.contiguous_format)
                and torch.device(kwargs.get("device") or "cpu").type == "cpu"):
            out = self.pool.take(args[0], kwargs.get("dtype") or torch.get_default_dtype())
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.recording.tensors.append(out)
        elif not _views(func, out, args, kwargs) and self.recording.refused is None:
            self.recording.refused = str(func)
        return out


def _views(func, out, args, kwargs) -> bool:
    """Whether the op's outputs are views of its inputs' memory. An op whose schema says it
    may alias (`to`, `contiguous`) makes a new tensor when it has to: that is computing; so is
    `lift_fresh` (torch.tensor's data, filled from Python)."""
    if not func.is_view or func is torch.ops.aten.lift_fresh.default:
        return False
    try:
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        return all(o.untyped_storage().data_ptr() in inputs for o in pytree.tree_leaves(out)
                   if isinstance(o, torch.Tensor))
    except (RuntimeError, NotImplementedError):     # a tensor without storage (oneDNN's, sparse)
        return False


@contextlib.contextmanager
def record(pool: Pool | None = None) -> Iterator[Recording]:
    """Record the kernel calls made by this thread inside the block (they run as usual too);
    contiguous CPU buffers allocated meanwhile come from `pool`, from its start, where given."""
    if getattr(_local, "recording", None) is not None:
        raise RuntimeError("already recording")
    rec = Recording()
    _local.recording = rec
    if pool is not None:
        pool.used = 0
        rec.tensors.append(pool.buffer)
    try:
        with _Guard(rec, pool):
            yield rec
    finally:
        _local.recording = None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Inside a recording, code whose work is not part of what is recorded: state made once and
    kept (a linear's weight packed on first use), which later replays only read. Its torch ops
    are not refused and its kernel calls not noted; its tensors are not kept by the recording
    (their owner keeps them). Outside a recording it changes nothing."""
    rec = getattr(_local, "recording", None)
    if rec is None:
        yield
        return
    _local.recording = None     # the guard (_Guard) lets ops pass while its recording is not the thread's
    try:
        yield
    finally:
        _local.recording = rec


class RecordableCDLL(ctypes.CDLL):
    """ctypes.CDLL whose functions note their calls in the thread's recording, if any."""

    def __init__(self, path: str) -> None:
        super().__init__(path)

        class _FuncPtr(self._FuncPtr):
            _flags_ = self._FuncPtr._flags_
            _restype_ = self._FuncPtr._restype_

            def __call__(self, *args):
                result = super().__call__(*args)
                rec = getattr(_local, "recording", None)
                if rec is not None:
                    rec.calls.append((self, args, result))
                return result
        self._FuncPtr = _FuncPtr
