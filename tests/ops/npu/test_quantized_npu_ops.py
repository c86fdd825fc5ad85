"""The NPU quantized linears (vlinfer/ops/npu/quant.py via NpuOps) against quant_reference on CPU
tensors, through the emulated torch_npu ops of tests/fakes/fake_torch_npu_quant.py, plus the
emulation rejecting calls the contracts do.

Tolerances (max |npu - reference| / max |reference|): the int8 codes and the integer products are
exact on both sides, so W8A8 differs only by the final rounding to bf16/fp16 (one ulp: 1e-2 bf16,
2e-3 fp16). Weight-only: the op's dequantized weight is in the activation dtype and its scale is
cast to it (the reference keeps them in float32): 2e-2 bf16, 4e-3 fp16."""
import logging

import pytest
import torch

from fake_torch_npu import FakeNpuError, loaded
from vlinfer.ops.reference import quant as quant_reference

SHAPES = [(1, 64, 32), (7, 128, 96), (33, 256, 160)]  # (M, K, N)
W8A8_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
WEIGHT_ONLY_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_err(ours, ref):
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def int8_weight(n, k, g):
    return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)


def dynamic_tensors(n, k, g):
    return {
        "weight": int8_weight(n, k, g), "weight_scale": torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    }


def static_tensors(n, k, g):
    weight = int8_weight(n, k, g)
    offset = torch.tensor([3.0])
    return {
        "weight": weight, "input_scale": torch.tensor([0.02]), "input_offset": offset,
        "quant_bias": (torch.randint(-500, 500,
                                     (n, ), generator=g) - 3 * weight.int().sum(1)).to(torch.int32),
        "deq_scale": torch.rand(n, generator=g) * 1e-3 + 1e-4
    }


def weight_only_tensors(n, k, g, bits, groups):
    low, high = (-128, 128) if bits == 8 else (0, 16)
    tensors = {
        "weight": torch.randint(low, high, (n, k), generator=g, dtype=torch.int8),
        "weight_scale": (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    }
    if bits == 4:
        tensors["weight_zero"] = torch.full((n, groups), 8.0).to(torch.bfloat16)
    return tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_w8a8_dynamic_equals_reference(monkeypatch, dtype, with_bias):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        tensors = dynamic_tensors(n, k, g)
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
        packed = ops.pack_quantized_linear("w8a8_dynamic", tensors)
        assert packed["weight"].shape == (k, n)  # transposed once, at load
        ours = ops.w8a8_dynamic_linear(x, packed, bias)
        ref = quant_reference.w8a8_dynamic_linear(x, tensors, bias)
        assert ours.dtype == dtype and ours.shape == (m, n)
        assert rel_err(ours, ref) < W8A8_TOL[dtype], (m, k, n)
    assert fake.calls["npu_dynamic_quant"] == len(SHAPES) and fake.calls["npu_quant_matmul"] == len(
        SHAPES)
    assert set(fake.last["npu_quant_matmul"]) >= {"pertoken_scale", "output_dtype"}


def test_w8a8_static_equals_reference(monkeypatch):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(1)
    for m, k, n in SHAPES:
        tensors = static_tensors(n, k, g)
        # 3-D: flattened to rows and back
        x = (torch.randn(2, m, k, generator=g) * 2).to(torch.bfloat16)
        packed = ops.pack_quantized_linear("w8a8_static", tensors)
        ours = ops.w8a8_static_linear(x, packed)
        ref = quant_reference.w8a8_static_linear(x, tensors)
        assert ours.shape == (2, m, n)
        assert rel_err(ours, ref) < W8A8_TOL[torch.bfloat16]
        # The codes are the reference's exactly: x / input_scale + input_offset, rounded, clamped.
        codes = fake.npu_quantize(x.reshape(-1, k), packed["input_scale"], packed["input_offset"],
                                  torch.qint8, -1, True)
        assert torch.equal(
            codes,
            quant_reference.quantize_per_tensor(x.reshape(-1, k), tensors["input_scale"],
                                                tensors["input_offset"]))
    assert fake.last["npu_quant_matmul"]["bias"].dtype == torch.int32  # quant_bias in the bias slot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits, group", [(8, 0), (8, 32), (4, 64)],
                         ids=["w8-channel", "w8-g32", "w4-g64"])
def test_weight_only_equals_reference(monkeypatch, dtype, bits, group):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(2)
    for m, k, n in SHAPES[1:]:
        tensors = weight_only_tensors(n, k, g, bits, k // group if group else 1)
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        packed = ops.pack_quantized_linear(f"w{bits}a16", tensors)
        ours = ops.weight_only_linear(x, packed, bias)
        ref = quant_reference.weight_only_linear(x.float(), tensors, bias.float())
        assert ours.dtype == dtype and rel_err(ours, ref) < WEIGHT_ONLY_TOL[dtype], (m, k, n)
        assert fake.last["npu_weight_quant_batchmatmul"]["antiquant_group_size"] == group
    assert fake.calls["npu_weight_quant_batchmatmul"] == 2


def test_what_the_ops_cannot_take_runs_the_reference_and_says_so(monkeypatch, caplog):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        for scheme, tensors, op in (("w8a8_dynamic", dynamic_tensors(32, 64,
                                                                     g), ops.w8a8_dynamic_linear),
                                    ("w8a8_static", static_tensors(32, 64,
                                                                   g), ops.w8a8_static_linear),
                                    ("w8a16", weight_only_tensors(32, 64, g, 8,
                                                                  1), ops.weight_only_linear)):
            ref = getattr(quant_reference, op.__name__)(x, tensors)
            # float32: the reference, on a transposed view of the NPU layout: the CPU's BLAS may sum
            # that in another order (on an AMD EPYC it does), so within float32 rounding rather than
            # bit for bit
            assert rel_err(op(x, ops.pack_quantized_linear(scheme, tensors)), ref) < 1e-6
        # a static layer in float16 (its fp32 deq_scale needs bf16 output) and a group of 16 columns
        static = static_tensors(32, 64, g)
        ops.w8a8_static_linear(x.half(), ops.pack_quantized_linear("w8a8_static", static))
        grouped = weight_only_tensors(32, 64, g, 8, 4)
        out = ops.weight_only_linear(x.bfloat16(), ops.pack_quantized_linear("w8a16", grouped))
        assert rel_err(out, quant_reference.weight_only_linear(x.bfloat16(), grouped)) < 1e-6
    assert sum(fake.calls[op] for op in ("npu_quant_matmul", "npu_weight_quant_batchmatmul")) == 0
    assert ("w8a8_dynamic_linear runs the pure-torch reference: activations are torch.float32"
            in caplog.text)
    assert ("w8a8_static_linear runs the pure-torch reference: activations are torch.float16"
            in caplog.text)
    assert "multiple of 32 in [32, K-1]" in caplog.text


def test_emulated_ops_reject_what_the_contracts_reject(fake_npu_quant):
    fake = fake_npu_quant
    w = torch.zeros(64, 32, dtype=torch.int8)
    x_q = torch.zeros(4, 64, dtype=torch.int8)
    scale = torch.ones(32)
    with pytest.raises(FakeNpuError, match="float16/bfloat16"):
        fake.npu_dynamic_quant(torch.randn(4, 64))
    with pytest.raises(FakeNpuError, match="do not chain"):
        fake.npu_quant_matmul(x_q, w.t().contiguous(), scale, output_dtype=torch.bfloat16)
    with pytest.raises(FakeNpuError, match="1 or N"):
        fake.npu_quant_matmul(x_q, w, torch.ones(5), output_dtype=torch.bfloat16)
    with pytest.raises(FakeNpuError, match="int64 scale"):
        fake.npu_quant_matmul(x_q, w, scale, output_dtype=torch.float16)
    with pytest.raises(FakeNpuError, match="pertoken_scale must be"):
        fake.npu_quant_matmul(x_q, w, scale, pertoken_scale=torch.ones(3),
                              output_dtype=torch.bfloat16)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(FakeNpuError, match="x's dtype"):
        fake.npu_weight_quant_batchmatmul(x, w, torch.ones(32))
    with pytest.raises(FakeNpuError, match="multiple of 32"):
        fake.npu_weight_quant_batchmatmul(x, w,
                                          torch.ones(4, 32).bfloat16(), antiquant_group_size=16)
    with pytest.raises(FakeNpuError, match="float32"):
        fake.npu_weight_quant_batchmatmul(x, w,
                                          torch.ones(32).bfloat16(), bias=torch.ones(32).bfloat16())
    with pytest.raises(FakeNpuError, match="1 or input.shape"):
        fake.npu_quantize(x, torch.ones(3), None, torch.qint8, -1, True)
    # the documented formulas on hand-checked values
    x_q, w = torch.tensor([[1, 2]], dtype=torch.int8), torch.tensor([[1, 2], [3, 4]],
                                                                    dtype=torch.int8)
    y = fake.npu_quant_matmul(x_q, w, torch.tensor([1.0, 0.5]),
                              bias=torch.tensor([1, -2],
                                                dtype=torch.int32), output_dtype=torch.bfloat16)
    assert y.tolist() == [[8.0, 4.0]]  # ([7, 10] + [1, -2]) * [1, 0.5]
    y = fake.npu_weight_quant_batchmatmul(torch.ones(1, 2).bfloat16(), w,
                                          torch.tensor([1.0, 2.0]).bfloat16(),
                                          antiquant_offset=torch.tensor([-1.0, 0.0]).bfloat16())
    assert y.tolist() == [[2.0, 12.0]]  # (w + offset) * scale, summed over K


@pytest.fixture
def fake_npu_quant(monkeypatch):
    from fake_torch_npu import install
    return install(monkeypatch)
