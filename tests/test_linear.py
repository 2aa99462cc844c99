"""layers/linear.py: the oneDNN path (weight reordered once) against torch's own linear."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tessera.layers.linear import Linear, onednn_supports


def _layer(dtype: torch.dtype, bias: bool, out_features: int = 36) -> Linear:
    """36 outputs: no register-tile kernel takes them (tile_linear wants 8 or 16 per block);
    48: the float32 one does where it is built."""
    torch.manual_seed(0)
    layer = Linear(96, out_features, bias=bias).to(dtype)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 64, 300])
def test_blocked_weight_path_equals_f_linear(dtype, rows):
    """bf16: bitwise F.linear's result; float32: within float32 rounding (another GEMM)."""
    if not onednn_supports(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    layer = _layer(dtype, bias=True)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    assert layer._blocked is not None, "the oneDNN path was not taken"
    ref = F.linear(x, layer.weight, layer.bias)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_weight_edited_or_replaced_after_first_use_is_not_stale():
    dtype = torch.bfloat16 if onednn_supports(torch.bfloat16) else torch.float32
    layer = _layer(dtype, bias=False)
    x = torch.randn(8, 96).to(dtype)
    layer(x)
    layer.weight.mul_(2)                                        # in place
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-2, atol=1e-2)
    layer.weight = torch.nn.Parameter(-layer.weight.detach(), requires_grad=False)  # replaced
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("out_features", [36, 48])
def test_copies_and_autograd_take_the_plain_path(out_features):
    """Both on the oneDNN path (36) and on a layer the float32 register tiles take (48): a copy
    makes its own derived weights, and a product that needs gradients (for the weight, or for
    the bias alone) is recorded by torch."""
    layer = _layer(torch.float32, bias=True, out_features=out_features)
    x = torch.randn(8, 96)
    layer(x)
    twin = copy.deepcopy(layer)                                 # an opaque tensor cannot be copied
    torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-5)
    layer.bias.requires_grad_(True)
    layer(x).sum().backward()
    assert layer.bias.grad is not None and torch.equal(layer.bias.grad, torch.full((out_features,), 8.0))
    layer.requires_grad_(True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape
