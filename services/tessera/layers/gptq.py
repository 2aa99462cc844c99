"""GPTQ (Frantar et al., 2023): the codes of one linear chosen against its inputs, in the same
format as round-to-nearest (layers/quant.py: QuantCodes), so the same kernels serve them.

Round-to-nearest rounds every weight on its own. GPTQ rounds the columns (input features) one
at a time and spreads each column's rounding error over the columns not yet rounded, in the
proportions that keep the layer's output on the calibration inputs X closest:

    H = X^T X (+ damping),   U = upper Cholesky factor of H^-1
    for column k:  q_k = round(w_k);  e = (w_k - q_k) / U[k, k];  w_j -= e · U[k, j] for j > k

Columns go in blocks of BLOCK; the error of a block reaches the later columns in one matrix
product ("lazy batch" updates). The per-group scale and offset (int4/int3) are those of
quantize_rtn, taken from the group's weights as they stand when its first column is reached
(the updates of earlier groups included); int8 keeps one symmetric scale per row, from the
weights before any update. With uncorrelated inputs of equal variance (H a multiple of I)
nothing is spread and the codes are round-to-nearest's.
"""
from __future__ import annotations

import torch

from tessera.layers.quant import COMPUTE_DTYPE, QuantCodes, group_scale_offset, row_scale

BLOCK = 128


def gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int = 32, damp: float = 0.01) -> QuantCodes:
    """GPTQ codes of weight w [N, K] for the inputs whose X^T X is `hessian` [K, K] (any
    positive scale: the damping is relative to its mean diagonal)."""
    W = w.detach().float().clone()
    n, k = W.shape
    if bits not in (3, 4, 8):
        raise ValueError(f"GPTQ supports 3, 4 and 8 bits, not {bits}")
    group = k if bits == 8 else group_size
    if k % group:
        raise ValueError(f"input size {k} is not a multiple of the group size {group}")
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0      # inputs the calibration never fired: rounded as if uncorrelated
    H[dead, dead] = 1.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    lowest, highest = (-127, 127) if bits == 8 else (0, 2 ** bits - 1)
    codes = torch.empty(n, k, dtype=torch.int16)
    scales = torch.empty(n, k // group)
    offsets = torch.zeros(n, k // group)
    if bits == 8:
        scales[:, 0] = row_scale(W)
    block = -(-BLOCK // group) * group if bits != 8 else BLOCK   # a group never straddles two blocks
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        W1, E = W[:, b0:b1].clone(), torch.empty(n, b1 - b0)
        for j in range(b1 - b0):
            col = b0 + j
            g = col // group
            if bits != 8 and col % group == 0:
                scales[:, g], offsets[:, g] = group_scale_offset(W1[:, j:j + group], bits)
            q = ((W1[:, j] - offsets[:, g]) / scales[:, g]).round().clamp(lowest, highest)
            codes[:, col] = q.to(torch.int16)
            E[:, j] = (W1[:, j] - (q * scales[:, g] + offsets[:, g])) / U[col, col]
            W1[:, j:] -= E[:, j:j + 1] * U[col, col:b1][None, :]
        W[:, b1:] -= E @ U[b0:b1, b1:]
    code_dtype = torch.int8 if bits == 8 else torch.uint8
    return QuantCodes(codes.to(code_dtype), scales.to(COMPUTE_DTYPE), offsets.to(COMPUTE_DTYPE), group)
