"""Token masks: llguidance writes one bit per vocabulary id (bit i of word w allows token
32 w + i); the sampler turns the bits of the constrained rows into -inf logits."""
from __future__ import annotations

import functools

import torch

# byte value -> its 8 bits, least significant first: the int32 words are little-endian in memory
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


@functools.lru_cache(maxsize=1)
def _executor(threads: int):
    import llguidance
    return llguidance.LLExecutor(num_threads=threads)


def fill(matchers: list, vocab_size: int) -> torch.Tensor:
    """The next-token bitmask of each matcher, [len(matchers), ceil(vocab / 32)] int32, computed
    in one call (llguidance spreads the rows over the torch threads, without the GIL)."""
    bitmask = torch.empty((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    # llguidance.torch wraps this call, but importing it imports torch.compile (seconds)
    _executor(max(1, torch.get_num_threads())).unsafe_compute_mask_ptr(
        [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask


def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """-inf, in place, for every id the bitmask does not allow in rows[i] (bitmask row i)."""
    vocab = logits.shape[1]
    allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
