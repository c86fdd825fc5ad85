"""The CUDA quantized linears (vlinfer/ops/cuda/quant.py via CudaOps) on CPU tensors: our Triton
kernels (vlinfer/ops/cuda/triton/int8_gemm.py, weight_only_gemm.py) under the Triton interpreter,
against quant_reference.

Tolerances (max |ours - reference| / max |reference|): W8A8 codes and integer products are exact and
the epilogue follows the reference's order, so float32 results are equal and bf16 within one
rounding (1e-2). Weight-only: the dequantized weight equals the reference's; only the summation
order differs: 1e-5 float32, 2e-2 bf16."""
import logging
import sys

import pytest
import torch

from vlinfer.ops.reference import quant as quant_reference
from vlinfer.ops.cuda import CudaOps

SHAPES = [(1, 64, 48), (17, 96, 130), (40, 128, 64)]  # (M, K, N): decode, odd tiles, two M tiles
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(ours, ref):
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module")
def cuda_ops():
    """CudaOps on CPU tensors with the Triton kernels interpreted; flash_attn hidden (attention is
    not tested here)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")  # read when a kernel is decorated, i.e. at load
    mp.setitem(sys.modules, "flash_attn", None)
    ops = CudaOps("cpu")
    ops.pack_quantized_linear("w8a16", {"weight": torch.zeros(16, 32, dtype=torch.int8),
                                        "weight_scale": torch.ones(16, 1)})
    assert ops.features[
        "quantized_linear"] == "triton", "the Triton kernels failed their load-time check"
    yield ops
    mp.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w8a8_dynamic_equals_reference(cuda_ops, dtype):
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        tensors = {"weight": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                   "weight_scale": torch.rand(n, 1, generator=g) * 0.01 + 1e-3}
        x = torch.randn(m, k, generator=g).to(dtype)
        # exact ties: half to even
        x[0, :3] = torch.tensor([0.5, -1.5, 2.5]) * x[0].abs().max() / 127 * 2
        bias = torch.randn(n, generator=g).to(dtype)
        packed = cuda_ops.pack_quantized_linear("w8a8_dynamic", tensors)
        ours = cuda_ops.w8a8_dynamic_linear(x, packed, bias)
        ref = quant_reference.w8a8_dynamic_linear(x, tensors, bias)
        assert ours.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(ours, ref), (m, k, n)
        else:
            assert rel_err(ours, ref) < 1e-2
    codes, scales = cuda_ops._triton_quant.int8.quantize_per_token(x.float())
    ref_codes, ref_scales = quant_reference.quantize_per_token(x.float())
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


def test_w8a8_static_equals_reference(cuda_ops):
    g = torch.Generator().manual_seed(1)
    for m, k, n in SHAPES:
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        tensors = {
            "weight": weight, "input_scale": torch.tensor([0.03]),
            "input_offset": torch.tensor([-4.0]),
            "quant_bias": (4 * weight.int().sum(1)).to(torch.int32),
            "deq_scale": torch.rand(n, generator=g)
        }
        x = torch.randn(2, m, k, generator=g) * 3  # saturates at both ends
        packed = cuda_ops.pack_quantized_linear("w8a8_static", tensors)
        assert torch.equal(cuda_ops.w8a8_static_linear(x, packed),
                           quant_reference.w8a8_static_linear(x, tensors))


@pytest.mark.parametrize(
    "scheme, signed, group, dtype", [("w8a16", True, 0, torch.bfloat16),
                                     ("w8a16", True, 32, torch.float32),
                                     ("w4a16", False, 32, torch.bfloat16),
                                     ("w4a16", False, 32, torch.float32),
                                     ("w4a16", True, 0, torch.bfloat16)], ids=[
                                         "w8-channel-bf16", "w8-g32-fp32", "w4-asym-g32-bf16",
                                         "w4-asym-g32-fp32", "w4-sym-channel-bf16"
                                     ])
def test_weight_only_equals_reference(cuda_ops, scheme, signed, group, dtype):
    g = torch.Generator().manual_seed(2)
    for m, k, n in SHAPES:
        groups = k // group if group else 1
        low, high = ((-128, 128) if scheme == "w8a16" else (-8, 8)) if signed else (0, 16)
        tensors = {
            "weight": torch.randint(low, high, (n, k), generator=g, dtype=torch.int8),
            "weight_scale": (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
        }
        if not signed:
            tensors["weight_zero"] = torch.randint(5, 11, (n, groups),
                                                   generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(dtype)
        packed = cuda_ops.pack_quantized_linear(scheme, tensors)
        assert packed["bits"] == (4 if scheme == "w4a16" else 8)
        ours = cuda_ops.weight_only_linear(x, packed, None)
        ref = quant_reference.weight_only_linear(x, tensors, None)
        assert ours.dtype == dtype and rel_err(ours, ref) < TOL[dtype], (m, k, n)


def test_kernels_that_do_not_load_leave_the_reference_and_say_so(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # no Triton on this machine
    ops = CudaOps("cpu")
    tensors = {
        "weight": torch.randint(-8, 8, (16, 32), dtype=torch.int8),
        "weight_scale": torch.rand(16, 1)
    }
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        packed = ops.pack_quantized_linear("w4a16", tensors)
    assert ops.features["quantized_linear"] == "reference"
    assert "Triton quantized GEMMs unavailable" in caplog.text
    x = torch.randn(3, 32)
    assert torch.equal(ops.weight_only_linear(x, packed),
                       quant_reference.weight_only_linear(x, tensors))
