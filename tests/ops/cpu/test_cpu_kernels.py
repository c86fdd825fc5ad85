"""Our compiled CPU kernels against the pure-torch reference over a grid of shapes, float32 and
bfloat16, on the generic build, the build for this CPU's best level (cpu_features.cpu_isa) and the
AVX2 build (tests/support/cpu_levels.py: its decode attention is code of its own, decode_avx2.h).
Each test asserts the path its level should take (the AVX512-BF16 kernels exactly at that level),
never a fixed CPU: CI runs on whatever machine it gets."""
import logging

import pytest
import torch
import torch.nn.functional as F

from cpu_levels import kernel_levels
from paged_batches import fp32, make_batch, rel_err, rel_err_per_seq
from vlinfer.platform import cpu_features
from vlinfer.ops import reference
from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.cpu import attention as cpu_prefill
from vlinfer.ops.cpu import panels as cpu_panels
from vlinfer.ops.select import select

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # max abs error relative to max |reference|
THIS_CPU = cpu_features.cpu_isa()
real_flags = cpu_features.cpu_flags()


@pytest.fixture(scope="module", params=kernel_levels())
def cpu(request):
    """The kernels built for one level; each level is its own extension (its own cache entry)."""
    # bf16_prefill_kernels=True: the prefill and vision kernels are tested on every CPU that can run
    # them, also where the engine prefers SDPA (AMX; test_bf16_prefill_kernels_follow_amx).
    ops = CpuOps(isa=request.param, bf16_prefill_kernels=True)
    assert ops.isa == request.param
    assert ops.bf16_attention == (
        request.param == "avx512bf16"), "the bf16 kernels exist at that level only"
    assert ops.bf16_prefill_kernels == ops.bf16_attention
    return ops


@pytest.mark.parametrize("flags", [{"avx512_bf16"}, {"avx512_bf16", "amx_bf16", "amx_tile"}],
                         ids=["no-amx", "amx"])
def test_bf16_prefill_kernels_follow_amx(cpu_ops, monkeypatch, caplog, flags):
    """With AMX, bf16 prefill and vision attention run SDPA (oneDNN's AMX path, ~3x our kernels
    there) and bf16 MoE experts keep the plain layout (the grouped GEMM's AMX tiles for prefill);
    without it, our AVX512-BF16 kernels where built (attention, expert panels); decode attention
    stays ours. CPU flags mocked (the kernels built are this machine's)."""
    mocked = real_flags | flags if "amx_bf16" in flags else real_flags - {"amx_bf16"}
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: mocked)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CpuOps(isa=cpu_ops.isa)
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    if not ops.bf16_attention:
        assert not ops.bf16_prefill_kernels and not ops._bf16_flash(q) and not ops.moe_panels
        pytest.skip(f"needs AVX512-BF16: the {ops.isa} build has no bf16 kernels to split by AMX")
    assert ops.bf16_prefill_kernels == ("amx_bf16" not in flags) == ops._bf16_flash(q) \
        == ops.moe_panels == (torch.bfloat16 in ops.panel_dtypes)
    assert torch.float32 in ops.panel_dtypes  # float32 panels on every AVX-512 level, AMX or not
    if "amx_bf16" in flags:
        assert "bf16 prefill and vision attention run SDPA (this CPU has AMX" in caplog.text
        assert ("bf16 MoE experts run on the grouped GEMM, small groups on expert_matmul "
                "(this CPU has AMX)") in caplog.text
    else:
        assert "bf16 attention kernels (AVX512-BF16): decode, prefill, vision" in caplog.text
        assert "bf16 MoE experts run in 32-output panels" in caplog.text


def test_compiled_kernels_load_on_this_machine(caplog):
    """An engine's CPU ops take the best level this CPU has and log it; nothing falls back."""
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = select("cpu")
    assert ops.name == "cpu-compiled" and ops.isa == THIS_CPU
    assert f"ops: {ops.describe()} implementation for cpu" in caplog.text and ops.describe(
    ).startswith(f"cpu-compiled ({THIS_CPU}")
    assert f"kernels built for {THIS_CPU}" in caplog.text
    assert "running the pure-torch reference" not in caplog.text


def test_decode_attention_kernels_follow_the_level(cpu, caplog):
    """Each level runs vector decode attention of its own (AVX2: decode_avx2.h; AVX-512:
    paged_ops.cpp, kv_quant.cpp, attention_bf16.cpp) and says which at load; only the generic build
    runs the plain loops."""
    kernels = cpu.ext.decode_attention_kernels()
    if cpu.isa == "generic":
        assert kernels == "the plain loops"
    elif cpu.isa == "avx2":
        assert kernels == "AVX2 (head_dim 64 / 128): float32, bf16, fp16, compressed caches"
    else:
        assert kernels.startswith("AVX-512 (head_dim 64 / 128): float32, compressed caches")
        assert ("bf16 (AVX512-BF16)" in kernels) == (cpu.isa == "avx512bf16")
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        CpuOps(isa=cpu.isa)
    assert f"ops[cpu]: decode attention kernels: {kernels}" in caplog.text


def test_a_level_this_cpu_lacks_is_refused(monkeypatch):
    """A level above the CPU's would die on an illegal instruction: refused before it is built or
    loaded."""
    monkeypatch.setattr(cpu_features, "cpu_flags",
                        lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    assert cpu_features.cpu_isa() == "avx2"
    with pytest.raises(RuntimeError, match="avx512bf16 cannot run on this CPU"):
        CpuOps(isa="avx512bf16")
    with pytest.raises(ValueError, match="unknown CPU kernel level"):
        CpuOps(isa="native")


# the generic build: one more build of the extension (tests/support/cpu_levels.py)
@pytest.mark.slow
def test_each_level_is_its_own_extension():
    """The kernel cache is keyed by level: a build for one CPU is never loaded on another that lacks
    its ISA."""
    names = {CpuOps(isa=level).ext.__name__ for level in ("generic", THIS_CPU)}
    assert names == {"vlinfer_cpu_kernels_generic", f"vlinfer_cpu_kernels_{THIS_CPU}"}


SHAPES = [(64, 1), (64, 2), (128, 8), (128, 1), (64, 8)]  # (head_dim, gqa ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim, gqa", SHAPES)
def test_paged_attention_decode_and_mixed(cpu, dtype, block_size, head_dim, gqa):
    num_kv_heads = 2
    # Decodes with lengths at and across block edges, then a mixed batch: prefill from scratch, a
    # chunk after a cached prefix, and decodes.
    for q_lens, kv_lens in [([1] * 6, [1, 15, 16, 17, 128, 129]), ([1], [300]),
                            ([1, 7, 1, 33, 1], [40, 7, 200, 161, 16])]:
        args = make_batch(q_lens, kv_lens, num_kv_heads * gqa, num_kv_heads, head_dim, block_size,
                          dtype)
        scale = head_dim ** -0.5
        ref = reference.paged_attention(*args, scale)
        ours = cpu.paged_attention(*args, scale)
        assert rel_err_per_seq(ours, ref, args[3]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (16, 8, 128), (4, 4, 32),
                                                       (8, 1, 80)])
def test_chunk_over_context_equals_one_masked_call(dtype, heads, kv_heads, head_dim):
    """cpu_prefill: a prefill chunk as two flash calls (its cached context, its own keys causally)
    merged by their log-sum-exps equals SDPA over all keys under the shifted causal mask."""
    g = torch.Generator().manual_seed(0)
    for n, kv_len in [(2, 3), (37, 200), (100, 101), (64, 1000), (300, 310)]:
        q = torch.randn(heads, n, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(kv_heads, kv_len, head_dim, generator=g).to(dtype) for _ in range(2))
        mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
        ref = F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)), attn_mask=mask,
                                             scale=0.1, enable_gqa=heads != kv_heads)
        ours = cpu_prefill.chunk_over_context(q, k, v, 0.1)
        assert ours.dtype == dtype and ours.shape == q.shape
        assert rel_err(ours.float(), ref) < TOL[dtype], (n, kv_len)


def test_float32_chunks_over_a_context_take_the_split(cpu, monkeypatch):
    """The op table's float32 prefill sends chunks after a cached context, and only those, to
    chunk_over_context."""
    seen, split = [], cpu_prefill.chunk_over_context

    def recording(q, k, v, scale):
        seen.append((q.shape[1], k.shape[1]))
        return split(q, k, v, scale)
    monkeypatch.setattr(cpu_prefill, "chunk_over_context", recording)
    args = make_batch([1, 7, 1, 33, 20], [40, 7, 200, 161, 20], 8, 2, 64, 16, torch.float32)
    ours = cpu.paged_attention(*args, 0.125)
    assert seen == [(33, 161)]
    assert rel_err_per_seq(ours, reference.paged_attention(*args, 0.125),
                           args[3]) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_splits_a_single_stream_by_kv_head(cpu, dtype):
    """Fewer sequences than threads: one work item per (sequence, kv head) instead of per sequence
    (a single stream's attention on every core, vlinfer/ops/cpu/csrc/decode_vectors.h DecodeItems);
    bit for bit the one-thread result, where each sequence is one item."""
    args = make_batch([1], [300], 8, 4, 64, 16, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu.ext.paged_decode_attention(args[0], *args[1:3], args[5], args[4], 0.125)
        torch.set_num_threads(max(2, threads))
        split = cpu.ext.paged_decode_attention(args[0], *args[1:3], args[5], args[4], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, one_thread)
    assert rel_err(split, reference.paged_attention(*args, 0.125)) < TOL[dtype]


def test_per_sequence_error_sees_an_off_by_one_the_global_max_hides():
    """A kv length one short at the end of the longest context: against one global max (set by a
    one-token context's large values) the error passes the bf16 bar; against that sequence's own
    scale it fails by far."""
    q, k_cache, v_cache, cu, lens, tables = make_batch([1] * 6, [1, 15, 16, 17, 128, 400], 4, 2, 64,
                                                       16, torch.float32)
    ref = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    short = lens.clone()
    short[-1] -= 1
    wrong = reference.paged_attention(q, k_cache, v_cache, cu, short, tables, 0.125)
    assert rel_err(wrong, ref) < TOL[torch.bfloat16] < rel_err_per_seq(wrong, ref, cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_store_kvcache_skips_padding(cpu, dtype, block_size):
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
def test_rotary_in_place(cpu, dtype, head_dim):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(29, (8 + 2 * 2) * head_dim, generator=g).to(dtype)
    # strided views, as in the model
    q, k, _ = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], -1)
    q, k = q.view(29, 8, head_dim), k.view(29, 2, head_dim)
    angles = torch.rand(29, head_dim // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = reference.apply_rotary(q.clone(), k.clone(), cos, sin)
    ours_q, ours_k = cpu.apply_rotary(q, k, cos, sin)
    assert rel_err(ours_q, ref_q) < TOL[dtype] and rel_err(ours_k, ref_k) < TOL[dtype]


NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max abs error relative to max |reference|


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# 72: 16-lane vectors and a scalar tail
@pytest.mark.parametrize("hidden", [64, 72, 128, 576, 2048])
def test_norms_and_activation(cpu, dtype, hidden):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, hidden, generator=g) * 4).to(dtype)
    residual = torch.randn(33, hidden, generator=g).to(dtype)
    # A NaN stays NaN through the vector rounding (a row of its own: it spreads through that row's
    # norm)
    x[32, 5] = float("nan")
    nan_out, nan_res = cpu.add_rms_norm(x[32:], residual[32:], torch.ones(hidden, dtype=dtype),
                                        1e-6)
    assert nan_res[0, 5].isnan() and nan_out[0].isnan().all()
    x = x[:32]
    residual = residual[:32]
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    assert rel_err(cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight,
                                                                     1e-6)) < NORM_TOL[dtype]
    (out, res), (ref_out, ref_res) = (cpu.add_rms_norm(x, residual, weight, 1e-6),
                                      reference.add_rms_norm(x, residual, weight, 1e-6))
    assert torch.equal(res, ref_res)  # the residual stream is one rounded add, bit for bit
    assert rel_err(out, ref_out) < NORM_TOL[dtype]
    # bf16: the kernel keeps the reference's rounding points, so almost every element is
    # bit-identical.
    assert (out != ref_out).float().mean() < (0.01 if dtype == torch.bfloat16 else 1.0)
    gate_up = (torch.randn(32, 2 * hidden, generator=g) * 3).to(dtype)
    assert rel_err(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)) < NORM_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_per_head_rms_norm_on_strided_views(cpu, dtype, head_dim):
    """Qwen3's q/k norm: RMSNorm over each head of a strided view into the fused qkv output."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(21, (8 + 2 * 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, :8 * head_dim].view(21, 8, head_dim)
    weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    assert not q.is_contiguous()
    assert rel_err(cpu.rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight,
                                                                     1e-6)) < NORM_TOL[dtype]


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim, gqa", [(64, 1), (128, 2), (128, 8), (80, 2)])
def test_bf16_prefill_attention_kernel(cpu, block_size, head_dim, gqa):
    """Prefill chunks on the AVX512-BF16 flash kernel over the paged cache (SDPA below that level):
    from scratch, after a cached prefix, longer than its query and key blocks, next to decodes.
    Error against exact attention within 1.5x SDPA's bf16 error (the reference runs SDPA) plus one
    bf16 rounding."""
    q_lens, kv_lens = [300, 1, 70, 2, 1], [300, 40, 470, 9, 200]
    q, k_cache, v_cache, cu, lens, tables = make_batch(q_lens, kv_lens, 2 * gqa, 2, head_dim,
                                                       block_size, torch.bfloat16, seed=7)
    scale = head_dim ** -0.5
    exact = reference.paged_attention(*fp32([q, k_cache, v_cache]), cu, lens, tables,
                                      scale).double()
    sdpa = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, scale)
    ours = cpu.paged_attention(q, k_cache, v_cache, cu, lens, tables, scale)
    # per sequence: scales differ little, but check each
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        e = exact[start:end]
        err = (ours[start:end].double() - e).abs().max().item()
        sdpa_err = (sdpa[start:end].double() - e).abs().max().item()
        assert err <= 1.5 * sdpa_err + 2 ** -8 * e.abs().max().item(), (start, err, sdpa_err)


def _exact_varlen_attention(q, k, v, cu_seqlens, scale):
    return reference.varlen_attention(q.double(), k.double(), v.double(), cu_seqlens, scale)


VISION_SEGMENTS = [([2160], 16, 64),            # a Qwen3-VL-2B image: 16 heads of 64
                   # segment and key-block edges, a one-patch segment
                   ([5, 64, 130, 1, 300], 4, 64),
                   ([100, 37], 2, 72),          # Qwen3-VL-8B's head_dim (not a multiple of 16)
                   ([33, 0, 20], 3, 16),        # an empty segment
                   ([300], 2, 128), ([50], 1, 8)]


@pytest.mark.parametrize("lens, heads, head_dim", VISION_SEGMENTS)
def test_vision_attention_kernel(cpu, lens, heads, head_dim):
    """The bf16 vision attention kernel (AVX512-BF16; SDPA below that level) on strided q/k/v views
    of one qkv tensor, as the tower passes them: its error against exact attention is SDPA's bf16
    error, give or take one bf16 rounding."""
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(sum(lens), 3, heads, head_dim, generator=g) * 2).bfloat16()
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    exact = _exact_varlen_attention(q, k, v, cu, scale)
    sdpa = reference.varlen_attention(q, k, v, cu, scale)
    ours = cpu.varlen_attention(q, k, v, cu, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    err, sdpa_err = (ours.double() - exact).abs().max().item(), (sdpa.double() -
                                                                 exact).abs().max().item()
    assert err <= 1.5 * sdpa_err + 2 ** -9 * exact.abs().max().item()
    # Most outputs round to the same bfloat16 as SDPA's.
    assert (ours == sdpa).float().mean() > 0.8
    # Segments are independent: a segment computed alone gives the same bits.
    first = lens[0]
    alone = cpu.varlen_attention(q[:first], k[:first], v[:first], cu[:2], scale)
    assert torch.equal(alone, ours[:first])


def test_vision_attention_dispatch(cpu):
    q, k, v = torch.randn(40, 3, 2, 64).unbind(1)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    # float32 runs SDPA (exact against transformers), bit for bit.
    assert torch.equal(cpu.varlen_attention(q, k, v, cu, 0.125),
                       reference.varlen_attention(q, k, v, cu, 0.125))
    if not cpu.bf16_prefill_kernels:  # below AVX512-BF16 bf16 runs SDPA too, bit for bit
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        assert torch.equal(cpu.varlen_attention(qb, kb, vb, cu, 0.125),
                           reference.varlen_attention(qb, kb, vb, cu, 0.125))
        pytest.skip(f"needs AVX512-BF16: the {cpu.isa} build has no bf16 vision attention kernel")
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        cpu.ext.vision_attention(q, k, v, cu, 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cpu.ext.vision_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                 torch.tensor([0, 15], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_tanh(cpu, dtype):
    """x * sigmoid(2u) in one pass: in bf16 within one rounding of the exact value (torch's 0.5x(1 +
    tanh u) cancels for negative x and is off by more there), in float32 within float32's own
    rounding of u."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(129, 1000, generator=g) * 3).to(dtype)
    x[0, :4] = torch.tensor([0.0, -30.0, 30.0, -6.0])
    # The exact value in float64, in the sigmoid form: 0.5 (1 + tanh u) cancels to nothing for u <
    # -18 even there.
    xd = x.double()
    exact = xd * torch.sigmoid(2 * 0.7978845608028654 * (xd + 0.044715 * xd ** 3))
    ours = cpu.gelu_tanh(x.clone())
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    if dtype == torch.bfloat16:
        assert ((ours.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-30).all()
        assert (ours == exact.to(dtype)).float().mean() > 0.99
    else:
        # float32 rounding of u (up to ~|2u| ulps through the exponential) bounds what any float32
        # GELU can do.
        assert ((ours.double() - exact).abs() <= 1e-5 * exact.abs() + 1e-12).all()
    torch.testing.assert_close(ours, reference.gelu_tanh(x),
                               rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    y = x.clone()
    # in place: the vision MLP's fc1 output is a temporary
    assert cpu.gelu_tanh(y).data_ptr() == y.data_ptr()


def test_norm_with_weight_in_another_dtype_keeps_the_reference_promotion(cpu):
    x, weight = torch.randn(5, 64).bfloat16(), torch.rand(64)
    out = cpu.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, reference.rms_norm(x, weight, 1e-6))


def test_bad_calls_are_rejected(cpu):
    q, k_cache, v_cache, cu, lens, tables = make_batch([1], [5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="int32"):
        cpu.ext.paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu.ext.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.store_kvcache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([10 ** 6]))


# bf16: AVX512-BF16 path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_padding_slots_with_nan_never_reach_the_output(cpu, impl, dtype):
    q, k_cache, v_cache, cu, lens, tables = make_batch([1, 1, 3], [5, 20, 9], 4, 2, 64, 16, dtype)
    clean = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    used = torch.zeros(k_cache.shape[0], 16, dtype=torch.bool)
    for row, n in zip(tables, lens.tolist()):
        for t in range(n):
            used[row[t // 16], t % 16] = True
    # what an empty (unzeroed) pool may hold
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    fn = reference.paged_attention if impl == "reference" else cpu.paged_attention
    out = fn(q, k_cache, v_cache, cu, lens, tables, 0.125)
    assert torch.isfinite(out).all() and torch.allclose(
        out, clean, atol=1e-5 if dtype == torch.float32 else 2e-2)


# (experts, N, K, rows per expert): K off the 32-element vector (the masked tail), N off the 4-row
# tile and the 64-row block, groups of 0..9 rows (more than one 4-row pass), rows past the last
# group left out.
EXPERT_MATMUL_GRID = [(4, 8, 64, [1, 0, 2, 1]), (8, 70, 48, [0, 5, 1, 0, 9, 0, 3, 4]),
                      (3, 130, 100, [2, 2, 7]), (16, 64, 2048, [1] * 16),
                      (5, 33, 17, [0, 0, 0, 0, 6])]


def expert_groups(case, dtype):
    """(x, w, ends, expected) for (experts, N, K, rows per expert): x sorted by expert plus two rows
    of no expert, expected each row times its expert's w^T in float32 (zero for the last two)."""
    experts, n, k, counts = case
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(experts, n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(sum(counts) + 2, k, generator=g).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    expected = torch.zeros(x.shape[0], n)
    starts = [0] + ends.tolist()
    for e in range(experts):
        expected[starts[e]:starts[e + 1]] = x[starts[e]:starts[e + 1]].float() @ w[e].float().T
    return x, w, ends, expected


# bf16: vdpbf16ps path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", EXPERT_MATMUL_GRID, ids=lambda c: f"e{c[0]}-n{c[1]}-k{c[2]}")
def test_expert_matmul_equals_grouped_matmul(cpu, case, dtype):
    x, w, ends, expected = expert_groups(case, dtype)
    out = cpu.ext.expert_matmul(x, w, ends)
    assert out.dtype == dtype and out.shape == expected.shape
    assert (out[-2:] == 0).all()
    assert rel_err(out, expected) < TOL[dtype]


def test_expert_matmul_rejects_bad_groups(cpu_ops):
    w = torch.zeros(2, 8, 16)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        cpu_ops.ext.expert_matmul(torch.zeros(3, 16), w, torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="at most the row count"):
        cpu_ops.ext.expert_matmul(torch.zeros(3, 16), w, torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.ext.expert_matmul(torch.zeros(3, 16), w, torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.ext.expert_matmul(
            torch.zeros(3, 16).bfloat16(), w, torch.tensor([2, 3], dtype=torch.int32))


# (experts, N, K, rows per expert) for the panel kernel: N in whole 32-output panels, an odd count
# of them (a work item of one panel), K even, groups of 0..20 rows (the 4-row tile, the 8-row tile
# and its tails).
EXPERT_PANEL_GRID = [(4, 64, 64, [1, 0, 2, 1]), (8, 96, 48, [0, 5, 1, 0, 9, 0, 3, 4]),
                     (3, 160, 100, [2, 13, 20]), (16, 64, 2048, [1] * 16)]


@pytest.mark.parametrize("case", EXPERT_PANEL_GRID, ids=lambda c: f"e{c[0]}-n{c[1]}-k{c[2]}")
def test_expert_panel_matmul_equals_grouped_matmul(cpu, case):
    """Weights packed by cpu_panels.to_panels; AVX512-BF16 builds run it, every other level refuses
    by name."""
    x, w, ends, expected = expert_groups(case, torch.bfloat16)
    panels = cpu_panels.to_panels(w)
    assert bool(cpu.ext.expert_panels_available()) == (cpu.isa == "avx512bf16")
    if not cpu.ext.expert_panels_available():
        with pytest.raises(RuntimeError, match="needs an AVX512-BF16 build"):
            cpu.ext.expert_panel_matmul(x, panels, ends)
        pytest.skip(f"needs AVX512-BF16: the {cpu.isa} build has no expert panels (refusal "
                    "checked)")
    out = cpu.ext.expert_panel_matmul(x, panels, ends)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    assert (out[-2:] == 0).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    with pytest.raises(RuntimeError, match="panels must be contiguous bf16"):
        cpu.ext.expert_panel_matmul(x, w, ends)  # the plain [E, N, K] layout
    with pytest.raises(RuntimeError, match="x must be bf16"):
        cpu.ext.expert_panel_matmul(x.float(), panels, ends)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        cpu.ext.expert_panel_matmul(x, panels, ends.flip(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, n, k", [(1, 560, 576), (3, 70, 96), (33, 130, 1536), (100, 56, 64),
                                        (8, 3, 32), (7, 48, 64)], ids=lambda v: str(v))
def test_int8_layers_run_the_block_kernel_at_every_row_count(cpu_ops, rows, n, k, dtype):
    """A per-channel int8 layer with N off the VNNI panels' 32 outputs (those: test_int8_vnni.py)
    runs the GGUF block kernel as Q8_0 blocks of d = 1 times its channel scales (N off the 16-row
    group, rows past one 32-row tile): equal to the reference on the activations as the kernel
    holds them (float32 rounding), and within ~1e-5 of the float-activation W8A16 reference (the
    documented tolerance). bf16 activations from BF16_PANEL_ROWS rows take the bf16 panels instead,
    where this CPU has AVX512-BF16."""
    from vlinfer.ops.cpu import quant as cpu_quant
    from vlinfer.ops.reference import gguf as gguf_reference
    from vlinfer.ops.reference import quant as quant_reference
    g = torch.Generator().manual_seed(rows * n + k)
    tensors = {"weight": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
               "weight_scale": torch.rand(n, 1, generator=g) * 0.02}
    packed = cpu_ops.pack_quantized_linear("w8a16", tensors)
    assert packed["cpu"]["kind"] == "int8" and packed["cpu"]["weight"].dim() == 3
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    out = cpu_ops.weight_only_linear(x, packed, bias)
    kernels = cpu_ops._block_kernels()
    assert kernels.bf16_panels == (cpu_ops.isa == "avx512bf16")
    if dtype == torch.bfloat16 and rows >= cpu_quant.BF16_PANEL_ROWS and kernels.bf16_panels:
        assert torch.equal(
            out, kernels.int8_linear_bf16(x, packed["cpu"]["weight"], packed["cpu"]["scale"], bias))
    else:
        assert torch.equal(
            out, kernels.linear(x, packed["cpu"]["weight"], 8, bias, packed["cpu"]["scale"]))
    w = tensors["weight"].float() * tensors["weight_scale"]
    held = F.linear(gguf_reference.quantize_activations(x), w).to(dtype) + bias
    assert out.dtype == dtype and out.shape == (rows, n)
    assert rel_err(out, held) < (1e-6 if dtype == torch.float32 else TOL[dtype])
    # The two digits leave up to 1/(127 * 512) of each block's largest activation per element: ~2e-5
    # of the output's largest value on these shapes (measured), bounded at 1e-4 (the float32
    # tolerance of the project).
    assert rel_err(out, quant_reference.weight_only_linear(x, packed, bias)) < max(1e-4, TOL[dtype])


def test_int8_layers_off_the_block_size_run_the_reference_loudly(cpu_ops, caplog):
    """K not a multiple of 32 (the blocks' size) or group scales: dequantize + matmul, and the log
    says why."""
    from vlinfer.ops.reference import quant as quant_reference
    g = torch.Generator().manual_seed(0)
    odd = {"weight": torch.randint(-128, 128, (24, 40), generator=g, dtype=torch.int8),
           "weight_scale": torch.rand(24, 1, generator=g) * 0.02}
    groups = {"weight": torch.randint(-128, 128, (24, 64), generator=g, dtype=torch.int8),
              "weight_scale": torch.rand(24, 2, generator=g) * 0.02}
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        for tensors in (odd, groups):
            packed = cpu_ops.pack_quantized_linear("w8a16", tensors)
            assert "cpu" not in packed
            x = torch.randn(5, tensors["weight"].shape[1], generator=g)
            assert torch.equal(cpu_ops.weight_only_linear(x, packed, None),
                               quant_reference.weight_only_linear(x, packed, None))
    assert "K = 40 not a multiple of 32" in caplog.text and "group scales" in caplog.text


def test_int8_layers_without_block_kernels_run_the_reference_loudly(cpu_ops, monkeypatch, caplog):
    """The block kernels failing to build (no compiler) is logged once per engine; int8 layers keep
    the reference."""
    from vlinfer.ops.cpu import gguf as gguf_cpu

    def no_compiler(isa):
        raise RuntimeError("no c++ compiler")
    monkeypatch.setattr(gguf_cpu, "build_gguf_extension", no_compiler)
    ops = CpuOps(isa=cpu_ops.isa)
    tensors = {"weight": torch.ones(16, 32, dtype=torch.int8), "weight_scale": torch.ones(16, 1)}
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        packs = [ops.pack_quantized_linear("w8a16", tensors) for _ in range(2)]
    assert all("cpu" not in packed for packed in packs)
    assert caplog.text.count("GGUF block kernels unavailable (RuntimeError: no c++ compiler)") == 1
    assert "no GGUF kernels" in caplog.text


def _packs(dtype) -> bool:
    """Whether oneDNN runs a packed linear of this dtype on this CPU (bf16 needs AVX512-BF16 or
    AMX)."""
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _layout(weight) -> str:
    return "panels" if weight.dim() > 2 else "onednn" if weight.is_mkldnn else "plain"


def _expected_layout(ops, n: int, k: int, dtype) -> str:
    """Where this CPU's kernels take panels (float32 on AVX-512, bf16 on AVX512-BF16 without AMX)
    and the shape fits (whole 32-output panels, even k, a panel of at most PANEL_BYTES): panels;
    else oneDNN where it packs."""
    from vlinfer.ops.cpu.linear import PANEL_BYTES
    level = cpu_features.CPU_ISAS.index(ops.isa)
    takes = level >= cpu_features.CPU_ISAS.index("avx512") if dtype == torch.float32 else \
        ops.isa == "avx512bf16" and "amx_bf16" not in cpu_features.cpu_flags()
    assert (dtype in ops.panel_dtypes) == takes
    if takes and n % 32 == 0 and k % 2 == 0 and 32 * k * torch.empty(
        (), dtype=dtype).element_size() <= PANEL_BYTES:
        return "panels"
    return "onednn" if _packs(dtype) else "plain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(64, 64, 1), (96, 48, 3), (96, 48, 70), (960, 576, 5),
                                   (576, 1536, 17), (3072, 576, 130), (64, 2, 2), (64, 4096, 9)],
                         ids=lambda s: f"{s[0]}x{s[1]}-rows{s[2]}")
def test_panel_linear_equals_f_linear(cpu, shape, dtype):
    """Dense panels (vlinfer/ops/cpu/csrc/panel_linear.cpp) at every level: the product within one
    rounding of the float32 F.linear, with and without bias, at 1..130 rows (pairs of panels in
    4-row tiles; past 4 rows one panel per work item, an odd count of them included, in 8-row tiles;
    row blocks over the cores); a level without them refuses by name."""
    n, k, rows = shape
    g = torch.Generator().manual_seed(n + k)
    w, x, b = (torch.randn(n, k, generator=g) * 0.1).to(dtype), \
        torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    panels = cpu_panels.to_panels(w)
    if not cpu.ext.panel_linear_available(dtype):
        assert cpu_features.CPU_ISAS.index(cpu.isa) < cpu_features.CPU_ISAS.index(
            "avx512" if dtype == torch.float32 else "avx512bf16")
        with pytest.raises(RuntimeError, match="has no .* panels"):
            cpu.ext.panel_linear(x, panels)
        pytest.skip(f"needs {'AVX-512' if dtype == torch.float32 else 'AVX512-BF16'}: the "
                    f"{cpu.isa} build has no {dtype} panels (refusal checked)")
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = cpu.ext.panel_linear(x, panels, bias)
        assert out.dtype == dtype and out.shape == ref.shape
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.ext.panel_linear(x[:, :-2], panels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepacked_linear_layers(dtype, caplog, cpu_context):
    """pack_weights swaps every vlinfer linear layer's weight for the op table's layout in place (no
    second copy): our panels where this CPU takes them, else oneDNN's packed layout where it runs
    that dtype packed, and says so either way; the layers' outputs stay F.linear's: to float32
    rounding in float32, in bf16 bit for bit on oneDNN and within one bf16 rounding on the panels
    (another summation order)."""
    from torch import nn
    from vlinfer.engine.model_runner import pack_weights
    from vlinfer.layers import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    g = torch.Generator().manual_seed(5)
    ctx = cpu_context
    model = nn.Sequential(ReplicatedLinear(ctx, 64, 96, bias=True),
                          MergedColumnParallelLinear(ctx, 64, [48, 48]),
                          RowParallelLinear(ctx, 96, 64, bias=True)).to(dtype)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    plain = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in model]
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        pack_weights(model)
    layouts = [_expected_layout(ctx.ops, *w.shape, dtype) for w, _ in plain]
    assert [_layout(m.weight) for m in model] == layouts
    if "plain" not in layouts:
        assert "3 of 3 linear weights packed for cpu-compiled" in caplog.text
        assert all(m.weight.shape == w.shape for m, (w, _) in zip(model, plain)
                   if m.weight.is_mkldnn)
    else:
        # (the log names the layers' params_dtype, the context's float32: the model was moved to
        # bf16 after)
        assert "weights (cpu-compiled has no packed layout for them here)" in caplog.text
    # Row counts on each side of the padding buckets (ops.cpu.linear_rows_bucket): exact, padded to
    # a power of two, to a multiple of 64, and split into 512-row blocks and a rest
    # (linear_row_blocks).
    for rows in (7, 9, 33, 100, 600, 1100):
        for m, (w, b), layout in zip(model, plain, layouts):
            inp = torch.randn(rows, w.shape[1], generator=g).to(dtype)
            ours, ref = m(inp), torch.nn.functional.linear(inp, w, b)
            assert ours.shape == ref.shape
            if dtype == torch.float32:
                assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
            elif layout == "panels":
                assert rel_err(
                    ours, F.linear(inp.float(), w.float(),
                                   b.float() if b is not None else None)) < 1e-2
            else:
                assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_large_row_weights_stay_plain_in_float32(dtype, cpu_ops):
    """A weight whose layer only runs prefill-sized row counts: float32 stays plain (F.linear, MKL's
    sgemm); bf16 gets the layout it gets anyway."""
    weight = torch.randn(64, 96).to(dtype)
    packed = cpu_ops.pack_linear_weight(weight, large_rows=True)
    if dtype == torch.float32:
        assert packed is None and cpu_ops.pack_linear_weight(weight) is not None
    else:
        assert _layout_or_none(packed) == _layout_or_none(cpu_ops.pack_linear_weight(weight))


def _layout_or_none(weight) -> str | None:
    return None if weight is None else _layout(weight)


def test_linear_rows_buckets():
    """A prepacked linear runs at few distinct row counts (oneDNN keeps a JIT kernel per count):
    every count maps to a bucket at least as large, and 1..4096 rows touch at most 30 buckets."""
    from vlinfer.ops.cpu.linear import linear_rows_bucket
    buckets = {linear_rows_bucket(rows) for rows in range(1, 4097)}
    assert all(linear_rows_bucket(rows) >= rows for rows in range(1, 4097))
    assert [linear_rows_bucket(r) for r in (1, 8, 9, 17, 64, 65, 130, 512, 513, 1500)] == \
        [1, 8, 16, 32, 64, 128, 192, 512, 1024, 1536]
    assert len(buckets) <= 30, sorted(buckets)
    # Above 512 rows, whole 512-row blocks and then the rest in its own bucket where that pads fewer
    # rows.
    from vlinfer.ops.cpu.linear import linear_row_blocks
    assert linear_row_blocks(3152) == [3072, 80] and linear_row_blocks(600) == [512, 88]
    assert linear_row_blocks(1000) == [1000] and linear_row_blocks(512) == [
        512
    ] and linear_row_blocks(7) == [7]
    for rows in range(1, 4097):
        blocks = linear_row_blocks(rows)
        assert sum(blocks) == rows and all(linear_rows_bucket(b) in buckets for b in blocks)
        padding = sum(linear_rows_bucket(b) - b for b in blocks)
        assert padding <= linear_rows_bucket(rows) - rows and (rows <= 512 or padding <= 63), rows


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_prepacked_lm_head(tied, caplog, cpu_context):
    """The LM head's logits matmul runs on a packed weight where this CPU packs bf16: an untied
    head's weight is replaced, a tied head keeps the plain rows the embedding looks up and gets a
    packed copy (logged with its size). Logits stay F.linear's bit for bit (bf16), and the
    embedding's lookups are unchanged."""
    from torch import nn
    from vlinfer.engine.model_runner import pack_weights
    from vlinfer.layers import ParallelLMHead, VocabParallelEmbedding
    g = torch.Generator().manual_seed(6)
    model = nn.ModuleDict({"embed": VocabParallelEmbedding(cpu_context, 300, 64),
                           "head": ParallelLMHead(cpu_context, 300, 64)}).to(torch.bfloat16)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if tied:
        model["head"].weight = model["embed"].weight
    plain = model["head"].weight.detach().clone()
    ids, x = torch.tensor([0, 5, 299]), torch.randn(9, 64, generator=g).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        pack_weights(model)
    head = model["head"]
    if not _packs(torch.bfloat16):
        assert not head.weight.is_mkldnn and head.packed_weight is None
    elif tied:
        assert head.weight is model[
            "embed"].weight and not head.weight.is_mkldnn and head.packed_weight.is_mkldnn
        assert ("LM head tied to the embedding: a packed copy for the logits matmul (+0 MiB)"
                in caplog.text)
    else:
        assert head.weight.is_mkldnn and head.packed_weight is None
        assert "LM head tied" not in caplog.text
    assert torch.equal(head(x), torch.nn.functional.linear(x, plain))
    assert torch.equal(model["embed"](ids), plain[ids] if tied else model["embed"].weight[ids])


def test_engine_runs_prepacked_linears(qwen3_checkpoint):
    from vlinfer import LLM
    from vlinfer.layers.linear import LinearBase
    llm = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=1 << 22)
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    ops = llm.engine.model_runner.ctx.ops
    assert layers and all(
        _layout(m.weight) == _expected_layout(ops, m.output_size, m.input_size, torch.float32)
        for m in layers)
    head = llm.engine.model_runner.model.lm_head
    # tied
    assert _layout(head.packed_weight) == _expected_layout(ops, *head.weight.shape, torch.float32)
