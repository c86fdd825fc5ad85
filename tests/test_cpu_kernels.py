"""Our compiled CPU kernels against the pure-torch reference over a grid of shapes, float32 and bfloat16."""
import logging

import pytest
import torch

from paged_batches import make_batch, rel_err
from vlinfer.ops import cpu, reference
from vlinfer.ops.dispatch import select

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # max abs error relative to max |reference|


@pytest.fixture(scope="module", autouse=True)
def kernels():
    cpu.load()


def test_compiled_kernels_load_on_this_machine(caplog):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        assert select("cpu") == "cpu-compiled"
    assert "ops: cpu-compiled implementation for cpu" in caplog.text
    assert "running the pure-torch reference" not in caplog.text


SHAPES = [(64, 1), (64, 2), (128, 8), (128, 1), (64, 8)]  # (head_dim, gqa ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim, gqa", SHAPES)
def test_paged_attention_decode_and_mixed(dtype, block_size, head_dim, gqa):
    num_kv_heads = 2
    # Decodes with lengths at and across block edges, then a mixed batch: prefill from scratch, a chunk after a
    # cached prefix, and decodes.
    for q_lens, kv_lens in [([1] * 6, [1, 15, 16, 17, 128, 129]),
                            ([1, 7, 1, 33, 1], [40, 7, 200, 161, 16])]:
        args = make_batch(q_lens, kv_lens, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype)
        scale = head_dim ** -0.5
        ref = reference.paged_attention(*args, scale)
        ours = cpu.paged_attention(*args, scale)
        assert rel_err(ours, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_store_kvcache_skips_padding(dtype, block_size):
    g = torch.Generator().manual_seed(1)
    key = torch.randn(37, 2, 64, generator=g).to(dtype)
    value = torch.randn(37, 2, 64, generator=g).to(dtype)
    caches = [torch.zeros(6, block_size, 2, 64, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(6 * block_size, generator=g)[:37]
    slots[[3, 20]] = -1  # padding slots are skipped
    reference.store_kvcache(key, value, caches[0], caches[1], slots)
    cpu.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].view(-1, 2, 64)[slots[slots >= 0]].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place(dtype, head_dim):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(29, (8 + 2 * 2) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], -1)  # strided views, as in the model
    q, k = q.view(29, 8, head_dim), k.view(29, 2, head_dim)
    angles = torch.rand(29, head_dim // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = reference.apply_rotary(q.clone(), k.clone(), cos, sin)
    ours_q, ours_k = cpu.apply_rotary(q, k, cos, sin)
    assert rel_err(ours_q, ref_q) < TOL[dtype] and rel_err(ours_k, ref_k) < TOL[dtype]


NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max abs error relative to max |reference|


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [64, 128, 576, 2048])
def test_norms_and_activation(dtype, hidden):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, hidden, generator=g) * 4).to(dtype)
    residual = torch.randn(33, hidden, generator=g).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    assert rel_err(cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)) < NORM_TOL[dtype]
    (out, res), (ref_out, ref_res) = (cpu.add_rms_norm(x, residual, weight, 1e-6),
                                      reference.add_rms_norm(x, residual, weight, 1e-6))
    assert torch.equal(res, ref_res)  # the residual stream is one rounded add, bit for bit
    assert rel_err(out, ref_out) < NORM_TOL[dtype]
    # bf16: the kernel keeps the reference's rounding points, so almost every element is bit-identical.
    assert (out != ref_out).float().mean() < (0.01 if dtype == torch.bfloat16 else 1.0)
    gate_up = (torch.randn(33, 2 * hidden, generator=g) * 3).to(dtype)
    assert rel_err(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)) < NORM_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_per_head_rms_norm_on_strided_views(dtype, head_dim):
    """Qwen3's q/k norm: RMSNorm over each head of a strided view into the fused qkv output."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(21, (8 + 2 * 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, :8 * head_dim].view(21, 8, head_dim)
    weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    assert not q.is_contiguous()
    assert rel_err(cpu.rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6)) < NORM_TOL[dtype]


def test_norm_with_weight_in_another_dtype_keeps_the_reference_promotion():
    x, weight = torch.randn(5, 64).bfloat16(), torch.rand(64)
    out = cpu.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, reference.rms_norm(x, weight, 1e-6))


def test_bad_calls_are_rejected():
    q, k_cache, v_cache, cu, lens, tables = make_batch([1], [5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="int32"):
        cpu._ext.paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu._ext.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.store_kvcache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([10 ** 6]))


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_padding_slots_with_nan_never_reach_the_output(impl):
    q, k_cache, v_cache, cu, lens, tables = make_batch([1, 1, 3], [5, 20, 9], 4, 2, 64, 16, torch.float32)
    clean = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    used = torch.zeros(k_cache.shape[0], 16, dtype=torch.bool)
    for row, n in zip(tables, lens.tolist()):
        for t in range(n):
            used[row[t // 16], t % 16] = True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")  # what an empty (unzeroed) pool may hold
    fn = reference.paged_attention if impl == "reference" else cpu.paged_attention
    out = fn(q, k_cache, v_cache, cu, lens, tables, 0.125)
    assert torch.isfinite(out).all() and torch.allclose(out, clean, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepacked_linear_layers(dtype, caplog):
    """prepare_weights swaps every vlinfer linear layer's weight for oneDNN's packed layout in place (no second
    copy), and the layers' outputs stay F.linear's: bit for bit in bf16, to float32 rounding in float32."""
    from torch import nn
    from vlinfer.layers import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(ReplicatedLinear(64, 96, bias=True), MergedColumnParallelLinear(64, [48, 48]),
                          RowParallelLinear(96, 64, bias=True)).to(dtype)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    plain = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in model]
    x = torch.randn(7, 64, generator=g).to(dtype)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        cpu.prepare_weights(model)
    assert "3 linear weights prepacked for oneDNN" in caplog.text
    assert all(m.weight.is_mkldnn and m.weight.shape == w.shape for m, (w, _) in zip(model, plain))
    for m, (w, b) in zip(model, plain):
        inp = x if m.weight.shape[1] == 64 else torch.randn(7, 96, generator=g).to(dtype)
        ours, ref = m(inp), torch.nn.functional.linear(inp, w, b)
        assert torch.equal(ours, ref) if dtype == torch.bfloat16 else torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_engine_runs_prepacked_linears(qwen3_checkpoint):
    from vlinfer import LLM
    from vlinfer.layers.linear import LinearBase
    llm = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=1 << 22)
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.weight.is_mkldnn for m in layers)
