"""LLM-PQ's cost models (docs/design/pipeline.md#memory-model, #latency-model,
#communication-model): what a decoder layer costs in bytes and seconds.

- memory: one layer's weights at a bit-width (scales included, from the model's real linear
  shapes), its KV cache for the whole global batch at full length s + n, per-stage temporaries
  and stage 0's extras (embedding, LM head, logits);
- latency, per device type and bit-width: least-squares regressions fitted on profiled layer times
  (prefill features b, s, b·s, b·s², 1; decode b·(s+i), b, i, 1), evaluated only inside the
  profiled box (docs/design/pipeline.md#extrapolation), or a roofline of a published GPU
  (simulated: pipeline/roofline.py);
- communication per device pair: t = a + bytes / bandwidth.
Plain Python: the planner never imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

@dataclass(frozen=True)
class GpuSpec:
    """A GPU type's published numbers (devices.py loads them from gpu_specs.yaml): the roofline's input."""
    name: str
    memory_gib: float
    bandwidth_gbs: float
    fp16_tflops: float
    fp32_tflops: float
    link_gbs: float
    source: str


DENSE_BYTES = 2          # 16-bit weights, activations and KV (fp16 / bf16)
# The dtype `tessera profile-pq` measures in and pipeline topologies serve (plan_topology), as
# DENSE_BYTES counts: bfloat16 on every machine, not what --dtype auto picks (float32 where
# the CPU has no FMA vectors), so a profile costs the runtime that will run the plan.
PROFILE_DTYPE = "bfloat16"


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model the cost models need. family: 'llama' (separate
    q/k/v with GQA, SwiGLU gate/up/down, RMSNorm, no biases), 'opt' or 'bloom' (MHA, two-matrix
    FFN, LayerNorm, biases)."""
    name: str
    family: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int = 0       # learned position embeddings (OPT); 0 with RoPE / ALiBi
    tied: bool = True        # LM head shares the embedding
    rope_positions: int = 0  # rows of the float32 RoPE cos/sin tables every stage keeps (our runtime)

    def __post_init__(self) -> None:
        if self.family not in ("llama", "opt", "bloom"):
            raise ValueError(f"unknown model family {self.family!r}")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")

    def linears(self) -> tuple[tuple[str, int, int], ...]:
        """(name, fan_in, fan_out) of every linear of one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attn = (("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h))
        if self.family == "llama":
            return attn + (("gate", h, i), ("up", h, i), ("down", i, h))
        return attn + (("fc1", h, i), ("fc2", i, h))

    def small_params(self) -> int:
        """Norm weights and biases of one layer (kept 16-bit)."""
        if self.family == "llama":
            return 2 * self.hidden
        return 4 * self.hidden + sum(out for _, _, out in self.linears())

    def layer_params(self) -> int:
        return sum(a * b for _, a, b in self.linears()) + self.small_params()


# Published dims (Hugging Face config.json of facebook/opt-13b, -30b, -66b and bigscience/bloom).
SHAPES = {s.name: s for s in (
    ModelShape("opt-13b", "opt", 40, 5120, 20480, 40, 40, 128, 50272, positions=2050),
    ModelShape("opt-30b", "opt", 48, 7168, 28672, 56, 56, 128, 50272, positions=2050),
    ModelShape("opt-66b", "opt", 64, 9216, 36864, 72, 72, 128, 50272, positions=2050),
    ModelShape("bloom-176b", "bloom", 70, 14336, 57344, 112, 112, 128, 250880),
)}


def shape_from_config(name: str, cfg) -> ModelShape:
    """A Llama-family shape from tessera.models.model_config.ModelConfig."""
    if cfg.arch != "llama":
        raise ValueError(f"{name}: the LLM-PQ planner models dense Llama-family layers, not {cfg.arch}")
    return ModelShape(name, "llama", cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, 0, cfg.tie_word_embeddings,
                      cfg.max_position_embeddings)


def linear_bytes(fan_in: int, fan_out: int, bits: int, group_size: int = 32, int3_as_int4: bool = False) -> float:
    """A linear's weight at `bits`, scales included. Mirrors layers/quant.linear_weight_bytes:
    int8 one 16-bit scale per output row; int4/int3 a 16-bit (scale, offset) per group of
    group_size inputs. Our CPU kernels store int3 codes in the int4 layout (int3_as_int4)."""
    n = fan_in * fan_out
    if bits == 16:
        return DENSE_BYTES * n
    if bits == 8:
        return n + 2 * fan_out
    stored = 4 if (bits == 3 and int3_as_int4) else bits
    return n * stored / 8 + 4 * fan_out * math.ceil(fan_in / group_size)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per layer and per stage (FlexGen-style, docs/design/pipeline.md#memory-model)."""
    shape: ModelShape
    group_size: int = 32
    int3_as_int4: bool = False

    def weight_bytes(self, bits: int) -> float:
        w = sum(linear_bytes(a, b, bits, self.group_size, self.int3_as_int4) for _, a, b in self.shape.linears())
        return w + DENSE_BYTES * self.shape.small_params()

    def kv_bytes(self, seqs: int, tokens: int) -> float:
        """One layer's K and V for `seqs` sequences of `tokens` (16-bit, whatever the weights)."""
        return seqs * 2 * self.shape.kv_heads * self.shape.head_dim * tokens * DENSE_BYTES

    def layer_bytes(self, bits: int, batch: int, full_len: int) -> float:
        """A layer as a stage holds it: weights plus KV for every sequence of the global batch
        (all decode micro-batches pass every stage) at full length s + n."""
        return self.weight_bytes(bits) + self.kv_bytes(batch, full_len)

    def temp_bytes(self, xi: int, prompt_len: int, decode_batch: int, context: int) -> float:
        """The larger of one prefill micro-batch's and one decode micro-batch's live activations
        inside a layer (hidden states, q/k/v, FFN intermediates, attention scores), and the RoPE
        tables a stage keeps."""
        sh = self.shape
        per_token = 2 * sh.hidden + (sh.heads + 2 * sh.kv_heads) * sh.head_dim + 3 * sh.intermediate
        prefill = xi * prompt_len * per_token + xi * sh.heads * prompt_len ** 2
        decode = decode_batch * per_token + decode_batch * sh.heads * context
        return DENSE_BYTES * max(prefill, decode) + 2 * 4 * sh.rope_positions * sh.head_dim

    def extras_bytes(self, xi: int, decode_batch: int, first: bool = True, head: bool = True) -> float:
        """Pre/post-processing, where the runtime keeps it: the first stage holds the
        embeddings; the head's stage (our runtime's last, pipeline/shard.py; LLM-PQ's first)
        the final norm, an LM head (its own copy even when tied to the embedding, unless it is
        also the first stage) and the float32 logits of the last token of each sequence of a
        micro-batch."""
        sh = self.shape
        embed = (sh.vocab + sh.positions) * sh.hidden if first else 0
        head_bytes = (0 if (first and sh.tied) else sh.vocab * sh.hidden) + sh.hidden if head else 0
        logits = 4 * max(xi, decode_batch) * sh.vocab if head else 0
        return DENSE_BYTES * (embed + head_bytes) + logits


# ----------------------------------------------------------------------------------------------
# Latency: regressions on profiled points


def _prefill_features(b: float, s: float, i: float) -> tuple[float, ...]:
    return (b, s, b * s, b * s * s, 1.0)


def _decode_features(b: float, s: float, i: float) -> tuple[float, ...]:
    return (b * (s + i), b, i, 1.0)


def _prepost_prefill_features(b: float, s: float, i: float) -> tuple[float, ...]:
    return (b, b * s, 1.0)


def _prepost_decode_features(b: float, s: float, i: float) -> tuple[float, ...]:
    return (b, 1.0)


FEATURES: dict[str, Callable[[float, float, float], tuple[float, ...]]] = {
    "prefill": _prefill_features, "decode": _decode_features,
    "prepost_prefill": _prepost_prefill_features, "prepost_decode": _prepost_decode_features}


def _features(phase: str, rows_per_pass: int, b: float, s: float, i: float) -> tuple[float, ...]:
    """A decode kernel that reads the weights once per pass of k rows pays per pass as well as
    per row: one more feature, the passes ⌈b/k⌉ (the int4 GEMV at 5 rows costs what it does at 8)."""
    f = FEATURES[phase](b, s, i)
    if rows_per_pass == 1:
        return f
    if phase != "decode":
        raise ValueError(f"rows per pass only for decode, not {phase}")
    return (*f[:2], math.ceil(b / rows_per_pass), *f[2:])


@dataclass(frozen=True)
class Regression:
    """A latency fit: seconds = coef · features(b, s, i). Inputs are clamped into the profiled
    box [lo, hi] (per variable) and the result never drops below the fastest measured time, so a
    query outside the profile neither extrapolates a quadratic nor goes negative
    (docs/design/pipeline.md#extrapolation)."""
    phase: str
    coef: tuple[float, ...]
    lo: tuple[float, float, float]
    hi: tuple[float, float, float]
    floor: float
    rows_per_pass: int = 1   # decode: the weights are read once per pass of this many rows

    def features(self, b: float, s: float, i: float) -> tuple[float, ...]:
        return _features(self.phase, self.rows_per_pass, b, s, i)

    @classmethod
    def fit(cls, phase: str, points: Sequence[tuple[float, float, float, float]],
            rows_per_pass: int = 1) -> "Regression":
        """Least squares on (b, s, i, seconds), relative error weighted (1 / seconds): a stage
        sums layers of one size, so every point's error counts in percent, as it is reported."""
        x = np.array([_features(phase, rows_per_pass, b, s, i) for b, s, i, _ in points], dtype=float)
        y = np.array([t for *_, t in points], dtype=float)
        if len(points) < x.shape[1] or (y <= 0).any():
            raise ValueError(f"{phase}: need at least {x.shape[1]} points with positive times")
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        w = 1.0 / y
        coef, *_ = np.linalg.lstsq(x / scale * w[:, None], y * w, rcond=None)
        box = np.array([p[:3] for p in points], dtype=float)
        return cls(phase, tuple(float(c) for c in coef / scale), tuple(box.min(axis=0)), tuple(box.max(axis=0)),
                   float(y.min()), rows_per_pass)

    def covers(self, b: float, s: float, i: float = 0.0) -> bool:
        return all(lo <= v <= hi for v, lo, hi in zip((b, s, i), self.lo, self.hi))

    def predict(self, b: float, s: float, i: float = 0.0) -> float:
        b, s, i = (min(max(v, lo), hi) for v, lo, hi in zip((b, s, i), self.lo, self.hi))
        return max(sum(c * f for c, f in zip(self.coef, self.features(b, s, i))), self.floor)

    def to_dict(self) -> dict:
        return {"phase": self.phase, "coef": list(self.coef), "lo": list(self.lo), "hi": list(self.hi),
                "floor": self.floor, "rows_per_pass": self.rows_per_pass}

    @classmethod
    def from_dict(cls, d: dict) -> "Regression":
        return cls(d["phase"], tuple(d["coef"]), tuple(d["lo"]), tuple(d["hi"]), d["floor"], d.get("rows_per_pass", 1))


@dataclass(frozen=True)
class Piecewise:
    """One Regression per range of rows where the layer's linears change kernel (a decode step
    runs b rows): piece k covers splits[k-1] < b <= splits[k], the last one every larger b. The
    int4 linears, for example, run a GEMV up to 16 rows and dequantize for a GEMM above, and no
    single (b·(s+i), b, i, 1) fit spans both (layers/quant.py: decode_regimes)."""
    splits: tuple[int, ...]
    pieces: tuple[Regression, ...]

    def __post_init__(self) -> None:
        if len(self.pieces) != len(self.splits) + 1 or list(self.splits) != sorted(set(self.splits)):
            raise ValueError(f"{len(self.pieces)} pieces for splits {self.splits}")

    @classmethod
    def fit(cls, phase: str, points: Sequence[tuple[float, float, float, float]],
            regimes: Sequence[tuple[int, int]] = ((0, 1),)) -> "Piecewise":
        """regimes: (most rows, rows per pass) of each kernel in turn, the last (0, k) for every
        larger b (layers/quant.py: decode_regimes). A regime with too few points to fit joins
        the next one, so a profile without points on both sides of a kernel change still fits."""
        def need(per_pass: int) -> int:
            return len(_features(phase, per_pass, 1.0, 1.0, 1.0))
        kept: list[tuple[int, int]] = []
        lo = 0
        for (most, per_pass), (_, next_pass) in zip(regimes, regimes[1:]):
            if (sum(lo < p[0] <= most for p in points) >= need(per_pass)
                    and sum(p[0] > most for p in points) >= need(next_pass)):
                kept.append((most, per_pass))
                lo = most
        kept.append((math.inf, regimes[-1][1]))
        bounds = [0, *(most for most, _ in kept)]
        ranges = [[p for p in points if a < p[0] <= b] for a, b in zip(bounds, bounds[1:])]
        # a range too thin for the passes feature is fitted without it
        pieces = tuple(Regression.fit(phase, pts, per_pass if len(pts) >= need(per_pass) else 1)
                       for pts, (_, per_pass) in zip(ranges, kept))
        return cls(tuple(most for most, _ in kept[:-1]), pieces)

    def piece(self, b: float) -> Regression:
        return self.pieces[sum(b > split for split in self.splits)]

    def covers(self, b: float, s: float, i: float = 0.0) -> bool:
        return self.piece(b).covers(b, s, i)

    def predict(self, b: float, s: float, i: float = 0.0) -> float:
        return self.piece(b).predict(b, s, i)

    def to_dict(self) -> dict:
        return {"splits": list(self.splits), "pieces": [r.to_dict() for r in self.pieces]}

    @classmethod
    def from_dict(cls, d: dict) -> "Piecewise":
        """Also reads a single Regression's dict (a profile written before the pieces)."""
        if "pieces" not in d:
            return cls((), (Regression.from_dict(d),))
        return cls(tuple(d["splits"]), tuple(Regression.from_dict(r) for r in d["pieces"]))


@dataclass(frozen=True)
class ProfiledLatency:
    """A device type's latency from `tessera profile pq`: per bit-width, one decoder layer's
    prefill regression and decode regressions (one per kernel regime); the pre/post-processing
    (embedding, final norm, head) when profiled."""
    fits: dict[int, tuple[Regression, Regression | Piecewise]]
    prepost: tuple[Regression, Regression] | None = None
    label: str = "profiled"

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted(self.fits))

    @classmethod
    def from_profile(cls, data: dict, source: str = "") -> "ProfiledLatency":
        if data.get("dtype", PROFILE_DTYPE) != PROFILE_DTYPE:
            raise ValueError(f"the profile was taken in {data['dtype']}: pipelines serve and the cost model "
                             f"counts {PROFILE_DTYPE}; profile again (`tessera profile-pq`)")
        fits = {int(b): (Regression.from_dict(f["prefill"]), Piecewise.from_dict(f["decode"]))
                for b, f in data["fits"].items()}
        pp = data.get("prepost")
        prepost = (Regression.from_dict(pp["prefill"]), Regression.from_dict(pp["decode"])) if pp else None
        return cls(fits, prepost, f"profiled ({source})" if source else "profiled")

    def prefill(self, bits: int, b: int, s: int) -> float:
        return self.fits[bits][0].predict(b, s)

    def decode(self, bits: int, b: int, s: int, i: int) -> float:
        return self.fits[bits][1].predict(b, s, i)

    def prepost_prefill(self, b: int, s: int) -> float:
        return self.prepost[0].predict(b, s) if self.prepost else 0.0

    def prepost_decode(self, b: int) -> float:
        return self.prepost[1].predict(b, 1) if self.prepost else 0.0

    def outside(self, xi: int, s: int, b: int, i: int) -> list[str]:
        """The planning queries that fall outside the profiled box (their times are clamped)."""
        pre, dec = next(iter(self.fits.values()))
        out = [] if pre.covers(xi, s) else [f"prefill (b={xi}, s={s})"]
        return out + ([] if dec.covers(b, s, i) else [f"decode (b={b}, s={s}, i={i})"])


# ----------------------------------------------------------------------------------------------
# Communication


@dataclass(frozen=True)
class Link:
    """Transfer time between two devices: latency_s + bytes / bandwidth."""
    latency_s: float = 0.0
    bandwidth_gbs: float = math.inf

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_gbs <= 0:
            raise ValueError("a link needs latency >= 0 and bandwidth > 0")

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.bandwidth_gbs * 1e9)

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "Link":
        """Least squares of seconds on bytes over measured (bytes, seconds); a >= 0."""
        x = np.array([[p[0], 1.0] for p in points], dtype=float)
        y = np.array([p[1] for p in points], dtype=float)
        if len(points) < 2 or np.ptp(x[:, 0]) == 0:
            raise ValueError("a link fit needs points at two or more payload sizes")
        (slope, a), *_ = np.linalg.lstsq(x, y, rcond=None)
        if slope <= 0:
            raise ValueError("link points do not grow with the payload")
        return cls(max(float(a), 0.0), 1.0 / (float(slope) * 1e9))
