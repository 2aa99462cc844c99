"""A minimal GGUF parser: metadata and memory-mapped tensor bytes, plus fast dequantization
of the common llama.cpp formats (F32, F16, BF16, Q8_0, Q4_0, Q4_1). Other formats fall back
to the gguf package. gguf.GGUFReader builds Python objects for every array element (8 s for
SmolLM2's 49k-token vocabulary); this reads only what we use."""
from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]   # torch order (the file stores it innermost first)
    ggml_type: int
    data: np.ndarray          # raw bytes (uint8), a view into the memory map


class GGUFFile:
    def __init__(self, path: str) -> None:
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._unpack(f"<{self._unpack('<I')[0]}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [GGUFTensor(n, s, t, self._buf[start + o:start + o + _nbytes(s, t)])
                        for n, s, t, o in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self._mv[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _strings(self, n: int) -> list[str]:
        """n strings in one tight loop (a vocabulary and its merges: ~100k of them)."""
        mv, pos, length, out = self._mv, self._pos, struct.Struct("<Q").unpack_from, []
        for _ in range(n):
            (k,) = length(mv, pos)
            out.append(str(mv[pos + 8:pos + 8 + k], "utf-8", "replace"))
            pos += 8 + k
        self._pos = pos
        return out

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, n = self._unpack("<IQ")
            if item_type in _SCALARS and item_type != 7:
                fmt = _SCALARS[item_type]
                arr = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=n, offset=self._pos)
                self._pos += n * arr.itemsize
                return arr.tolist()
            if item_type == _STRING:
                return self._strings(n)
            return [self._value(item_type) for _ in range(n)]
        return self._unpack(_SCALARS[vtype])[0]


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared by the config, tensor and tokenizer readers of one load (each
    parse reads the ~100k vocabulary strings); a file rewritten in place is parsed again."""
    st = os.stat(path)
    return _parsed(os.fspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return int(np.prod(shape)) // block * size


def dequantize(t: GGUFTensor) -> np.ndarray:
    """float32 array of t.shape."""
    raw = t.data
    if t.ggml_type == 0:
        out = raw.view(np.float32)
    elif t.ggml_type == 1:
        out = raw.view(np.float16).astype(np.float32)
    elif t.ggml_type == 30:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t.ggml_type in (2, 3, 8):
        out = _dequant_blocks(raw, t.ggml_type)
    else:
        import gguf
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(t.shape)


def _dequant_blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Q8_0: x = d*q; Q4_0: x = d*(q-8); Q4_1: x = d*q + m; blocks of 32, low nibbles first."""
    block_bytes = {2: 18, 3: 20, 8: 34}[ggml_type]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if ggml_type == 8:
        return d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    head = 2 if ggml_type == 2 else 4
    qs = blocks[:, head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if ggml_type == 2:
        return d * (q - 8.0)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return d * q + m
