"""Latency of one decoder layer on a published GPU running the kernels LLM-PQ's prototype ran
at each bit-width: a roofline from the datasheet (pipeline/gpu_specs.yaml). Simulated: no GPU
was measured. It answers the same queries as costmodel.ProfiledLatency, for the paper's cluster
cases (paper_cases.py) and `tessera plan pq` devices named by GPU type.
"""
from __future__ import annotations

from dataclasses import dataclass

from tessera.pipeline.costmodel import DENSE_BYTES, GpuSpec, MemoryModel


@dataclass(frozen=True)
class Kernel:
    """How LLM-PQ's runtime multiplies by one bit-width's weights, as far as time goes, per
    parameter and call: the bytes a separate dequantizing kernel moves first (cast_bytes), the
    bytes of weight the matmul reads (None: the stored size), whether the matmul reads them again
    for every token (a matrix-vector kernel launched over the tokens), and the units that do its
    math ('fp16' tensor cores or 'fp32' CUDA cores)."""
    name: str
    cast_bytes: float
    matmul_bytes: float | None
    per_token: bool
    math: str


# The prototype's bit-widths {3, 4, 8:tc-li, 16} (docs/design/pipeline.md#roofline), as LPTorch
# builds them (github.com/tonyzhao-jt/LPTorch, lptorch/AdaQLinear.py,
# lptorch/extern_qlinear_constructor.py). Structure read from the kernels' source, not fitted: no
# number here is tuned to a result.
KERNELS = {
    16: Kernel("torch FP16 GEMM", 0.0, None, False, "fp16"),
    # bitsandbytes Linear8bitLt (LLM.int8(), threshold 6.0) with state.force_no_igemmlt = True: every
    # call casts the int8 weight to a new FP16 tensor and runs an FP16 GEMM on it (bitsandbytes
    # autograd/_functions.py, MatMul8bitLt.forward without igemmlt): the cast reads 1 byte and
    # writes 2 per parameter, the GEMM reads the 2, on FP16 tensor cores (never INT8 ones). Even
    # the INT8 (igemmlt) path was published slower than FP16: 15-23 % on BLOOM-176B, 2.6-3.7x on
    # T5-11B on a T4 (huggingface.co/blog/hf-bitsandbytes-integration, "Is it faster than native
    # models?").
    8: Kernel("bitsandbytes LLM.int8() (no igemmlt)", 1.0 + DENSE_BYTES, DENSE_BYTES, False, "fp16"),
    # LPTorch's GPTQ QuantLinear (lptorch/gptq, GPTQ's VecQuant{3,4}MatMulKernel): the input is cast
    # to FP32 and each token is its own grid slice (blockIdx.z) streaming the whole packed weight
    # and multiply-adding on CUDA cores, so a matrix larger than L2 is read from memory again for
    # every token. In the 11 paper cases every quantized matrix exceeds its GPU's L2 (T4, P100 4 MB;
    # V100 6 MB; A100 40 MB: NVIDIA's architecture whitepapers) except OPT-66B's 3-bit attention
    # matrices (32 MB) on A100, where L2 reuse, not modelled, would make them faster than here.
    4: Kernel("GPTQ vecquant4matmul (FP32, per token)", 0.0, None, True, "fp32"),
    3: Kernel("GPTQ vecquant3matmul (FP32, per token)", 0.0, None, True, "fp32"),
}


@dataclass(frozen=True)
class Roofline:
    """One layer's time on a GPU = max(bytes / bandwidth, math time), from the datasheet, for
    the kernel LLM-PQ ran at each bit-width (KERNELS): FP16 GEMMs; LLM.int8() as a per-call
    int8 -> FP16 cast plus an FP16 GEMM; GPTQ 3/4-bit as an FP32 matrix-vector kernel per token.
    Attention and the KV cache are FP16 at every bit-width. Simulated: no GPU was measured."""
    spec: GpuSpec
    memory: MemoryModel
    label: str = "simulated (roofline)"
    bits: tuple[int, ...] = (3, 4, 8, 16)

    def _peak(self, math_unit: str) -> float:
        return (self.spec.fp32_tflops if math_unit == "fp32" else self.spec.fp16_tflops) * 1e12

    def _seconds(self, nbytes: float) -> float:
        return nbytes / (self.spec.bandwidth_gbs * 1e9)

    def _time(self, bits: int, tokens: int, attn_flops: float, attn_bytes: float) -> float:
        """The dequantizing pass (its own memory-bound kernel, so added), then the layer's
        matmuls and attention as one roofline: max(bytes / bandwidth, time of their math)."""
        sh, k = self.memory.shape, KERNELS[bits]
        params = sum(a * b for _, a, b in sh.linears())
        stored = self.memory.weight_bytes(bits) - DENSE_BYTES * sh.small_params()
        weights = (stored if k.matmul_bytes is None else k.matmul_bytes * params) * (tokens if k.per_token else 1)
        act = DENSE_BYTES * tokens * sum(a + b for _, a, b in sh.linears())
        nbytes = weights + act + DENSE_BYTES * sh.small_params() + attn_bytes
        math_s = 2 * tokens * params / self._peak(k.math) + attn_flops / self._peak("fp16")
        return self._seconds(k.cast_bytes * params) + max(self._seconds(nbytes), math_s)

    def prefill(self, bits: int, b: int, s: int) -> float:
        sh = self.memory.shape
        d = sh.heads * sh.head_dim
        scores = 2 * DENSE_BYTES * b * sh.heads * s * s           # written, then read by softmax @ V
        return self._time(bits, b * s, 4 * b * s * s * d, scores + self.memory.kv_bytes(b, s))

    def decode(self, bits: int, b: int, s: int, i: int) -> float:
        sh = self.memory.shape
        ctx = s + i + 1
        return self._time(bits, b, 4 * b * ctx * sh.heads * sh.head_dim, self.memory.kv_bytes(b, ctx))

    def _head(self, tokens: int) -> float:
        sh = self.memory.shape
        nbytes = DENSE_BYTES * sh.vocab * sh.hidden + 4 * tokens * sh.vocab
        return max(self._seconds(nbytes), 2 * tokens * sh.vocab * sh.hidden / self._peak("fp16"))

    def prepost_prefill(self, b: int, s: int) -> float:
        return self._head(b)

    def prepost_decode(self, b: int) -> float:
        return self._head(b)

    def outside(self, xi: int, s: int, b: int, i: int) -> list[str]:
        return []
