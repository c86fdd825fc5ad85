"""The CUDA ops (vlinfer/ops/cuda/, CudaOps) on CPU tensors: dispatch, the Triton cache write under
the Triton interpreter, the SDPA / matmul attention paths and the flash_attn wiring through an
emulated flash_attn (tests/fakes/fake_flash_attn.py), each against the pure-torch reference over a
grid of shapes; and two instances keeping their own state.

Tolerances: max |ours - reference| / max |reference| per sequence (tests/support/paged_batches.py),
the reference in float32 on the same (rounded) inputs: float32 2e-5, bfloat16 2e-2 (the CPU kernel
tests' values). Cache writes must be exact.
"""
import itertools
import logging
import sys

import pytest
import torch

from paged_batches import (CUDA_ATTENTION_TOL as TOL, fp32, make_batch, rel_err, rel_err_per_seq,
                           short_reads, tf32, tf32_paged_attention)
from fake_flash_attn import FakeFlashError, install
from vlinfer.engine import graph_runner
from vlinfer.ops import OPS, ReferenceOps, reference
from vlinfer.ops.select import select
from vlinfer.ops.cuda import CudaOps
from vlinfer.ops.cuda import attention as cuda_attention

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NUM_KV_HEADS = 2


def batches(block_size):
    """Decodes at and across block edges; then prefill from scratch, a chunk after a cached prefix
    crossing a block edge, a prefix hit of 3 tokens after one full block, and decodes, mixed in one
    call."""
    b = block_size
    return [([1] * 6, [1, b - 1, b, b + 1, 2 * b, 2 * b + 7]),
            ([7, 1, b + 2, 1, 40, 3], [7, 3 * b, b + 2, b + 1, b + 40, b + 3])]


@pytest.fixture
def sdpa_only(monkeypatch):
    """CudaOps on CPU tensors with flash_attn absent and our Triton attention failing to load: the
    reference's attention (the sync-free matmul decode, SDPA per sequence); the cache write as on
    this machine."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    monkeypatch.setattr(cuda_attention, "checked_attention",
                        lambda device: (_ for _ in ()).throw(RuntimeError("no Triton")))
    ops = CudaOps("cpu")
    assert ops.features["attention"] == "reference" and ops.features[
        "paged_attention"] == "reference"
    return ops


@pytest.fixture
def fake_flash(monkeypatch):
    """The emulated flash_attn, installed."""
    return install(monkeypatch)


@pytest.fixture
def flash_ops(fake_flash):
    """CudaOps on CPU tensors over the emulated flash_attn, its history cleared of the load-time
    check."""
    ops = CudaOps("cpu")
    assert ops.features["attention"] == "flash_attn"
    fake_flash.history.clear()
    return ops


def overridden(cls) -> set[str]:
    """The ops cls implements itself rather than inheriting from the reference."""
    return {op for op in OPS if getattr(cls, op) is not getattr(ReferenceOps, op)}


# ---- dispatch ----

def test_cuda_device_selects_the_cuda_implementation(monkeypatch, caplog):
    monkeypatch.delenv("VLINFER_OPS", raising=False)
    loaded = []

    def init(self, device_type="cuda"):  # no GPU needed: record the load, skip the kernels
        loaded.append(device_type)
        ReferenceOps.__init__(self, device_type)
    monkeypatch.setattr(CudaOps, "__init__", init)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = select("cuda")
    assert type(ops) is CudaOps and ops.name == "cuda" and ops.device_type == "cuda"
    assert loaded == ["cuda"]
    assert "ops: cuda implementation for cuda" in caplog.text
    # The attention ops, the cache write, the fused MoE, LoRA and linear attention are CUDA's;
    # rotary, the norms, SwiGLU, GELU and linear stay on the reference.
    assert overridden(CudaOps) == {
        "store_kvcache", "paged_attention", "varlen_attention", "fused_moe", "pack_moe_weights",
        "w8a8_dynamic_linear", "w8a8_static_linear", "weight_only_linear", "pack_quantized_linear",
        "store_quantized_kvcache", "quantized_paged_attention", "add_lora", "causal_conv1d",
        "gated_delta_rule"
    }
    assert ops.paged_attention.__func__ is CudaOps.paged_attention \
        and ops.rms_norm is reference.rms_norm
    assert select("cuda") is not ops  # a new op table per call: one per engine
    assert loaded == ["cuda", "cuda"]


def test_a_failing_cuda_load_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv("VLINFER_OPS", raising=False)

    def broken(self, device_type="cuda"):
        raise RuntimeError("no driver")
    monkeypatch.setattr(CudaOps, "__init__", broken)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert type(select("cuda")) is ReferenceOps
    assert ("CUDA kernels unavailable (RuntimeError: no driver); running the pure-torch reference"
            in caplog.text)


def test_vlinfer_ops_cuda_forces_it_on_cpu_tensors_and_only_there(monkeypatch):
    monkeypatch.setenv("VLINFER_OPS", "cuda")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    ops = select("cpu")
    assert type(ops) is CudaOps and ops.device_type == "cpu"
    with pytest.raises(RuntimeError, match="not on 'npu'"):
        select("npu")  # a forced implementation that cannot load is an error, not a fallback
    with pytest.raises(RuntimeError, match="not on 'npu'"):
        CudaOps("npu")


def test_missing_triton_is_a_warning_and_the_reference_write(monkeypatch, caplog):
    # what `import triton` sees without the package
    monkeypatch.setitem(sys.modules, "triton", None)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CudaOps("cpu")
    assert ops.features["cache_write"] == "reference"
    assert "Triton KV cache write unavailable (ModuleNotFoundError: import of triton" in caplog.text
    assert "decode steps cannot run in CUDA graphs" in caplog.text
    assert "ops[cuda]: cache write reference" in caplog.text
    # The write still happens, through the reference, padding skipped.
    key, value = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    ops.store_kvcache(key, value, k_cache, v_cache, torch.tensor([5, -1, 0, 31]))
    assert torch.equal(k_cache.view(-1, 2, 64)[[5, 0, 31]], key[[0, 2, 3]])
    assert k_cache.count_nonzero() == 3 * 2 * 64
    # And a CUDA device with these ops runs eager: the reference write syncs with the host.
    with pytest.raises(graph_runner.GraphModeUnavailable, match="Triton unavailable"):
        ops.graph_capture(torch.device("cuda"))
    ops.features["cache_write"] = "triton"  # what the check looks at
    assert ops.graph_capture(torch.device("cuda")).ops is ops


def test_flash_attn_absent_is_logged(monkeypatch, caplog):
    """The start-up log names the attention each engine runs: our Triton kernels (interpreted here),
    or the reference with a warning saying why when Triton cannot load."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CudaOps("cpu")
    assert ops.features["attention"] == "triton"
    assert "flash_attn not installed; attention runs our Triton kernels" in caplog.text
    assert "attention our Triton kernels (prefill, decode and the vision tower)" in caplog.text
    caplog.clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CudaOps("cpu")
    assert ops.features["attention"] == "reference"
    assert "Triton paged attention unavailable (ModuleNotFoundError" in caplog.text
    assert ("attention the pure-torch reference (prefill, decode and the vision tower)"
            in caplog.text)


# ---- Triton cache write, under the Triton interpreter ----

@pytest.fixture
def triton_interpreted(monkeypatch):
    import triton  # noqa: F401  (a test dependency: a missing one fails here, it is not skipped)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated, i.e. at load
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    ops = CudaOps("cpu")
    assert ops.features["cache_write"] == "triton", "the Triton kernel failed its load-time check"
    return ops


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim, num_kv_heads", [(64, 1), (64, 2), (128, 8), (128, 1)])
def test_triton_cache_write_equals_reference(triton_interpreted, dtype, block_size, head_dim,
                                             num_kv_heads):
    g = torch.Generator().manual_seed(block_size + head_dim + num_kv_heads)
    num_blocks = 5
    # A prefill crossing block edges and decodes, as strided views of a fused qkv row, with padding
    # slots.
    num_tokens = block_size + 9
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    _, key, value = qkv.split([4 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, num_tokens - 1]] = -1
    caches = [
        torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)
    ]
    reference.store_kvcache(key, value, caches[0], caches[1], slots)
    triton_interpreted.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]].abs().sum() > 0


def test_triton_cache_write_casts_like_the_reference(triton_interpreted):
    # float32 activations into a bf16 cache
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    ours = [torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    ref = [torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([2, 9, -1])
    triton_interpreted.store_kvcache(key, value, *ours, slots)
    reference.store_kvcache(key, value, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    with pytest.raises(ValueError, match="do not match"):
        triton_interpreted.store_kvcache(key[:, :1], value, *ours, slots)


# ---- attention without flash_attn ----

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 8])
def test_sdpa_paged_attention_equals_reference(sdpa_only, gqa, head_dim, block_size, dtype):
    for q_lens, kv_lens in batches(block_size):
        args = make_batch(q_lens, kv_lens, NUM_KV_HEADS * gqa, NUM_KV_HEADS, head_dim, block_size,
                          dtype)
        ref = reference.paged_attention(*fp32(args), head_dim ** -0.5)
        ours = sdpa_only.paged_attention(*args, head_dim ** -0.5)
        assert ours.dtype == dtype and ours.shape == args[0].shape
        assert rel_err_per_seq(ours, ref, args[3]) < TOL[dtype]


def test_decode_attention_takes_no_host_sync(sdpa_only):
    """Meta tensors have no data: .tolist(), .item(), bool(tensor) and data-dependent shapes all
    raise on them, so a decode step that runs on meta tensors is one a CUDA graph can capture. The
    mixed path is shown to sync."""
    args = make_batch([1] * 4, [3, 40, 17, 1], 8, 2, 64, 16, torch.bfloat16, extra_width=3)
    meta = [a.to("meta") for a in args]
    out = sdpa_only.paged_attention(*meta, 0.125)
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16
    mixed = [a.to("meta") for a in make_batch([3, 1], [3, 40], 8, 2, 64, 16, torch.bfloat16)]
    with pytest.raises((RuntimeError, NotImplementedError)):
        sdpa_only.paged_attention(*mixed, 0.125)


def test_decode_attention_padding_rows_and_nan_slots():
    """A graph's padded rows (seq_len 0, table all -1) give zeros, not NaN; NaN in unused slots (an
    empty pool) and in the -1 padding's block 0 never reaches a real row."""
    q, k_cache, v_cache, cu, lens, tables = make_batch([1] * 3, [5, 20, 33], 4, 2, 64, 16,
                                                       torch.float32, extra_width=2)
    clean = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    used = torch.zeros(k_cache.shape[0], 16, dtype=torch.bool)
    for row, n in zip(tables, lens.tolist()):
        for t in range(n):
            used[row[t // 16], t % 16] = True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    q_pad = torch.cat([q, torch.randn(2, 4, 64)])
    lens_pad = torch.cat([lens, torch.zeros(2, dtype=torch.int32)])
    tables_pad = torch.cat([tables, torch.full((2, tables.shape[1]), -1, dtype=torch.int32)])
    out = cuda_attention.decode_attention(q_pad, k_cache, v_cache, lens_pad, tables_pad, 0.125)
    assert torch.allclose(out[:3], clean, atol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


# ---- attention through (emulated) flash_attn ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 8])
def test_flash_paged_attention_equals_reference(fake_flash, flash_ops, gqa, head_dim, dtype):
    block_size = 256
    for q_lens, kv_lens in batches(block_size):
        args = make_batch(q_lens, kv_lens, NUM_KV_HEADS * gqa, NUM_KV_HEADS, head_dim, block_size,
                          dtype)
        ref = reference.paged_attention(*fp32(args), head_dim ** -0.5)
        ours = flash_ops.paged_attention(*args, head_dim ** -0.5)
        assert rel_err_per_seq(ours, ref, args[3]) < TOL[dtype]
    (decode_fn, decode), (mixed_fn, mixed) = fake_flash.history
    assert decode_fn == "flash_attn_with_kvcache"
    assert decode["q_shape"] == (6, 1, NUM_KV_HEADS * gqa, head_dim) and decode["causal"]
    assert decode["cache_seqlens"] == batches(block_size)[0][1]
    assert mixed_fn == "flash_attn_varlen_func" and mixed["paged"] and mixed["causal"]
    kv_lens = batches(block_size)[1][1]
    assert mixed["cu_seqlens_k"] == [0, *itertools.accumulate(kv_lens)]
    assert mixed["max_seqlen_q"] == block_size + 2 and mixed["max_seqlen_k"] == max(kv_lens)
    assert mixed["softmax_scale"] == head_dim ** -0.5


def count_paged_meta(monkeypatch) -> list:
    """One entry per host-metadata build (each a device->host sync on a GPU)."""
    calls = []
    original = cuda_attention.paged_meta
    monkeypatch.setattr(cuda_attention, "paged_meta", lambda *a: calls.append(1) or original(*a))
    return calls


def test_flash_host_lengths_are_read_once_per_step(flash_ops, monkeypatch):
    args = make_batch([5, 1], [300, 9], 4, 2, 64, 256, torch.bfloat16)
    calls = count_paged_meta(monkeypatch)
    for _ in range(3):  # three layers of one step: same metadata tensors
        flash_ops.paged_attention(*args, 0.125)
    assert len(calls) == 1
    # the next step
    flash_ops.paged_attention(args[0], args[1], args[2], args[3].clone(), args[4], args[5], 0.125)
    assert len(calls) == 2


def test_two_instances_keep_their_own_state(fake_flash, monkeypatch, caplog):
    """Two engines' op tables in one process: what one loaded, cached or warned about is not the
    other's."""
    a = CudaOps("cpu")  # over the emulated flash_attn
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    b = CudaOps("cpu")  # made later, without flash_attn: must not switch `a` off it
    assert a.features["attention"] == "flash_attn" and b.features["attention"] == b.features[
        "paged_attention"]
    assert b._flash is None and a._flash is fake_flash
    assert a.decode_reads_only_used_blocks(256, torch.bfloat16)
    assert b.decode_reads_only_used_blocks(256,
                                           torch.bfloat16) == (b.features["attention"] == "triton")

    # Steps of the two engines interleaved, each over its own metadata tensors, layer after layer:
    # each instance builds its host metadata once for its step (one shared cache would rebuild it at
    # every switch).
    step_a = make_batch([5, 1], [300, 9], 4, 2, 64, 256, torch.bfloat16, seed=1)
    step_b = make_batch([3, 1, 1], [260, 40, 7], 4, 2, 64, 256, torch.bfloat16, seed=2)
    calls = count_paged_meta(monkeypatch)
    fake_flash.history.clear()
    for _ in range(3):
        for ops, args in ((a, step_a), (b, step_b)):
            assert rel_err_per_seq(ops.paged_attention(*args, 0.125),
                                   reference.paged_attention(*fp32(args), 0.125), args[3]) < 2e-2
    assert len(calls) == 1  # `a`'s step; `b` runs SDPA, which reads no metadata through it
    assert [fn for fn, _ in fake_flash.history] == ["flash_attn_varlen_func"] * 3  # `a` only
    b._flash = fake_flash  # now both on flash_attn: still one build per instance and step
    for _ in range(3):
        for ops, args in ((a, step_a), (b, step_b)):
            ops.paged_attention(*args, 0.125)
    assert len(calls) == 2
    assert a._step._key[0] is step_a[3] and b._step._key[0] is step_b[3]

    # Warnings are given once per engine: each instance says it runs SDPA for a float32 model.
    args32 = make_batch([1, 1], [5, 20], 4, 2, 64, 256, torch.float32)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        for ops in (a, b, a, b):
            ops.paged_attention(*args32, 0.125)
    assert caplog.text.count(
        "flash_attn takes float16 / bfloat16, the model runs torch.float32") == 2


@pytest.mark.parametrize("block_size, dtype, why",
                         [(16, torch.bfloat16, "not a multiple of 256"),
                          (256, torch.float32, "flash_attn takes float16 / bfloat16")])
def test_flash_unsupported_cases_run_ours_with_a_warning(fake_flash, flash_ops, caplog, block_size,
                                                         dtype, why):
    for q_lens, kv_lens in batches(block_size):
        args = make_batch(q_lens, kv_lens, 4, 2, 64, block_size, dtype)
        with caplog.at_level(logging.WARNING, logger="vlinfer"):
            ours = flash_ops.paged_attention(*args, 0.125)
        assert rel_err_per_seq(ours, reference.paged_attention(*fp32(args), 0.125),
                               args[3]) < TOL[dtype]
    assert not fake_flash.history
    assert caplog.text.count(why) == 1  # once, not per layer or step


def test_fake_flash_rejects_what_flash_attn_rejects(fake_flash):
    """The emulation has teeth: the block-size and dtype constraints the wiring works around are
    enforced."""
    q, k_cache, v_cache, cu, lens, tables = make_batch([1, 1], [5, 20], 4, 2, 64, 16,
                                                       torch.bfloat16)
    with pytest.raises(FakeFlashError, match="multiple of 256"):
        fake_flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens,
                                           block_table=tables)
    with pytest.raises(FakeFlashError, match="int32"):
        q, k_cache, v_cache, cu, lens, tables = make_batch([1, 1], [5, 20], 4, 2, 64, 256,
                                                           torch.bfloat16)
        fake_flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                           cache_seqlens=lens.long(), block_table=tables)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_attention_equals_reference(fake_flash, flash_ops, dtype, head_dim):
    g = torch.Generator().manual_seed(3)
    seg = [16, 64, 3, 100]
    q, k, v = (torch.randn(sum(seg), 4, head_dim, generator=g).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(seg)], dtype=torch.int32)
    ours = flash_ops.varlen_attention(q, k, v, cu, head_dim ** -0.5)
    ref = reference.varlen_attention(q.float(), k.float(), v.float(), cu, head_dim ** -0.5)
    assert rel_err_per_seq(ours, ref, cu) < TOL[dtype]
    if dtype == torch.float32:
        assert not fake_flash.history  # flash_attn takes half types: the reference ran
    else:
        (fn, kw), = fake_flash.history
        assert fn == "flash_attn_varlen_func" and not kw["causal"] and not kw["paged"]
        assert kw["max_seqlen_q"] == 100


def test_a_broken_flash_attn_is_a_warning(monkeypatch, caplog):
    fake = install(monkeypatch)
    # wrong results
    monkeypatch.setattr(fake, "flash_attn_with_kvcache", lambda *a, **k: torch.zeros(2, 1, 2, 64))
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CudaOps("cpu")
    assert ops.features["attention"] == ops.features["paged_attention"] and ops._flash is None
    assert "flash_attn unusable (RuntimeError: flash_attn is off from the reference" in caplog.text


# ---- compressed KV caches (kv_cache_dtype) in Triton, under the interpreter ----

COMPRESSED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
              "bfloat16": torch.bfloat16, "float16": torch.float16}


def compressed_scales(cache_dtype, num_blocks, block_size, num_kv_heads):
    if cache_dtype == torch.int8:
        return torch.ones(num_blocks, block_size,
                          num_kv_heads), torch.ones(num_blocks, block_size, num_kv_heads)
    # per-layer scales other than 1.0: their use is checked
    return torch.tensor(0.5), torch.tensor(2.0)


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_triton_quantizing_cache_write_equals_reference(triton_interpreted, name):
    from vlinfer.ops.reference import kv_cache as kv_quant_reference
    cache_dtype = COMPRESSED[name]
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(21, 8 * 64, generator=g) * 3
    # strided views
    key, value = (t.view(21, 2, 64) for t in qkv.split([2 * 64, 2 * 64, 4 * 64], -1)[:2])
    slots = torch.randperm(4 * 16, generator=g)[:21]
    slots[[0, 7]] = -1
    caches = [torch.zeros(4, 16, 2, 64, dtype=cache_dtype) for _ in range(4)]
    scales = [s.clone() for s in compressed_scales(cache_dtype, 4, 16, 2) * 2]
    triton_interpreted.store_quantized_kvcache(key, value, caches[0], caches[1], scales[0],
                                               scales[1], slots)
    kv_quant_reference.store_quantized_kvcache(key, value, caches[2], caches[3], scales[2],
                                               scales[3], slots)
    for ours, ref in zip(caches[:2] + scales[:2], caches[2:] + scales[2:]):
        assert torch.equal(
            ours.view(torch.uint8)
            if ours.dtype.itemsize == 1 and ours.is_floating_point() else ours,
            ref.view(torch.uint8) if ref.dtype.itemsize == 1 and ref.is_floating_point() else ref)
    assert triton_interpreted.features["quantized_kv_cache"] == "triton"


@pytest.mark.parametrize("name", ["int8", "fp8", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim, gqa", [(64, 1), (80, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_triton_paged_attention_over_compressed_caches_equals_reference(
        triton_interpreted, name, block_size, head_dim, gqa, dtype):
    """Prefill from scratch, a chunk after a cached prefix, a prefix hit and decodes in one launch,
    over a cache the reference wrote, against the reference's reading of the same stored rows."""
    from vlinfer.ops.reference import kv_cache as kv_quant_reference
    cache_dtype = COMPRESSED[name]
    for q_lens, kv_lens in batches(block_size):
        q, k_dense, v_dense, cu, lens, tables = make_batch(q_lens, kv_lens, NUM_KV_HEADS * gqa,
                                                           NUM_KV_HEADS, head_dim, block_size,
                                                           dtype)
        num_blocks = k_dense.shape[0]
        k_cache = torch.empty(k_dense.shape, dtype=cache_dtype)
        v_cache = torch.empty_like(k_cache)
        k_scale, v_scale = compressed_scales(cache_dtype, num_blocks, block_size, NUM_KV_HEADS)
        slots = torch.arange(num_blocks * block_size)
        kv_quant_reference.store_quantized_kvcache(k_dense.view(-1, NUM_KV_HEADS, head_dim),
                                                   v_dense.view(-1, NUM_KV_HEADS, head_dim),
                                                   k_cache, v_cache, k_scale, v_scale, slots)
        ours = triton_interpreted.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale,
                                                            cu, lens, tables, head_dim**-0.5)
        ref = reference.quantized_paged_attention(q.float(), k_cache, v_cache, k_scale, v_scale, cu,
                                                  lens, tables, head_dim**-0.5)
        assert ours.dtype == dtype and ours.shape == q.shape
        assert rel_err_per_seq(ours, ref, cu) < TOL[dtype], (q_lens, kv_lens)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_triton_compressed_read_with_a_swapped_scale_fails(triton_interpreted, name):
    """Negative control: the int8 decode reading the longest sequence's first two blocks with each
    other's key scales, the fp8 one with the key and value scales swapped, fails TOL per
    sequence."""
    from vlinfer.ops.reference import kv_cache as kv_quant_reference
    cache_dtype = COMPRESSED[name]
    q, k_dense, v_dense, cu, lens, tables = make_batch([1] * 3, [1, 40, 300], 4, NUM_KV_HEADS, 64,
                                                       16, torch.bfloat16)
    k_cache = torch.empty(k_dense.shape, dtype=cache_dtype)
    v_cache = torch.empty_like(k_cache)
    k_scale, v_scale = compressed_scales(cache_dtype, k_dense.shape[0], 16, NUM_KV_HEADS)
    kv_quant_reference.store_quantized_kvcache(k_dense.view(-1, NUM_KV_HEADS, 64),
                                               v_dense.view(-1, NUM_KV_HEADS, 64), k_cache, v_cache,
                                               k_scale, v_scale,
                                               torch.arange(k_dense.shape[0] * 16))
    ref = reference.quantized_paged_attention(q.float(), k_cache, v_cache, k_scale, v_scale, cu,
                                              lens, tables, 0.125)
    if name == "int8":
        wrong_k, wrong_v = k_scale.clone(), v_scale
        first, second = tables[2, :2].long()
        wrong_k[first], wrong_k[second] = k_scale[second], k_scale[first]
    else:
        wrong_k, wrong_v = v_scale, k_scale
    ours = triton_interpreted.quantized_paged_attention(q, k_cache, v_cache, wrong_k, wrong_v, cu,
                                                        lens, tables, 0.125)
    assert rel_err_per_seq(ours, ref, cu) > TOL[torch.bfloat16]

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_triton_paged_attention_over_the_compute_dtype_equals_reference(triton_interpreted, dtype):
    """The same kernel without scales (the cache of the compute dtype), a decode row of an empty
    sequence (a padded graph row: seq_len 0) giving zeros."""
    from vlinfer.ops.cuda.loader import load_triton_module
    attention = load_triton_module("paged_attention").paged_attention
    for q_lens, kv_lens in batches(16):
        args = make_batch(q_lens, kv_lens, NUM_KV_HEADS * 2, NUM_KV_HEADS, 64, 16, dtype)
        ref = reference.paged_attention(*fp32(args), 0.125)
        assert rel_err_per_seq(attention(*args, 0.125), ref, args[3]) < TOL[dtype]
    q, k_cache, v_cache, cu, lens, tables = make_batch([1, 1], [5, 1], 4, 2, 64, 16, dtype)
    out = attention(q, k_cache, v_cache, cu, torch.tensor([5, 0], dtype=torch.int32), tables, 0.125)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


# ---- our Triton attention over the compute dtype: the grid (issue 40), under the interpreter ----

BLOCK_SIZES = [16, 32, 64, 128, 256]
HEAD_DIM_GQA = [(64, 1), (80, 2), (96, 4), (128, 8), (256, 1), (64, 8)]
# Prefill from scratch, a chunk after a cached prefix crossing a block edge, decodes at and past a
# block edge, a one-token sequence, and a graph's empty row (seq_len 0, its table all -1), in one
# launch; tables one block wider than needed (-1 ids past each sequence's end).
SMALL_BATCH = ([7, 5, 1, 1, 1, 1], [7, 40, 16, 33, 1, 0])
# Query lengths to 512, contexts to 4096: a long prefill over a prefix, long and short decodes
# beside an empty row, prefill chunks and a decode mixed.
LARGE_BATCHES = {"prefill-512": ([512, 1], [700, 1]), "decode-4096": ([1] * 4, [4096, 1, 2049, 0]),
                 "mixed": ([33, 1, 200], [33, 3000, 900])}


def check_attention(ops, q_lens, kv_lens, block_size, head_dim, gqa, dtype):
    args = make_batch(q_lens, [max(n, 1) for n in kv_lens], NUM_KV_HEADS * gqa, NUM_KV_HEADS,
                      head_dim, block_size, dtype, seed=block_size + head_dim)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    args[5][lens == 0] = -1  # an empty row's table: all padding
    args = (*args[:4], lens, args[5])
    ours = ops.paged_attention(*args, head_dim ** -0.5)
    assert ours.dtype == dtype and ours.shape == args[0].shape
    rows = torch.repeat_interleave(lens, torch.tensor(q_lens)) > 0
    live = lens > 0
    cu_live = torch.nn.functional.pad(torch.tensor(q_lens)[live].cumsum(0), (1, 0)).to(torch.int32)
    ref = reference.paged_attention(
        *fp32((args[0][rows], args[1], args[2], cu_live, lens[live], args[5][live])),
        head_dim**-0.5)
    assert rel_err_per_seq(ours[rows], ref, cu_live) < TOL[dtype], (q_lens, kv_lens)
    assert (ours[~rows] == 0).all()  # an empty row gives zeros, not NaN


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim, gqa", HEAD_DIM_GQA)
def test_triton_attention_grid_equals_reference(triton_interpreted, block_size, head_dim, gqa):
    """The engine's dispatch (no flash_attn here) runs our kernel; prefill, prefix hits and decodes
    in one launch. Every block size with every head dim / GQA pair, the dtype in turn (each dtype
    meets every block size)."""
    assert triton_interpreted.features["attention"] == "triton"
    dtype = (torch.float32, torch.bfloat16,
             torch.float16)[(block_size // 16 + head_dim // 16 + gqa) % 3]
    check_attention(triton_interpreted, *SMALL_BATCH, block_size, head_dim, gqa, dtype)


# Each large batch at a few block sizes / head dims / dtypes; small blocks and 8-query-head groups
# (many programs and block iterations: 7-20 s each under the interpreter) in the slow tier.
LARGE_CASES = [
    ("prefill-512", 256, 80, 2, torch.float32), ("prefill-512", 128, 64, 1, torch.bfloat16),
    ("decode-4096", 128, 64, 1, torch.float16), ("decode-4096", 256, 256, 1, torch.bfloat16),
    ("decode-4096", 64, 128, 8, torch.float32), ("mixed", 128, 96, 4, torch.float32)
] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [("prefill-512", 16, 64, 1,
                  torch.float32), ("prefill-512", 64, 128, 8, torch.bfloat16),
                 ("mixed", 16, 80, 2, torch.bfloat16), ("mixed", 32, 64, 8, torch.float16)]
]


@pytest.mark.parametrize("batch, block_size, head_dim, gqa, dtype", LARGE_CASES,
                         ids=lambda v: DTYPE_IDS.get(v, str(v)))
def test_triton_attention_large_batches_equal_reference(triton_interpreted, batch, block_size,
                                                        head_dim, gqa, dtype):
    check_attention(triton_interpreted, *LARGE_BATCHES[batch], block_size, head_dim, gqa, dtype)


@pytest.mark.parametrize("splits, kv_lens", [(4, [1000, 1, 0]), (2, [1, 4096]),
                                             (16, [300, 33, 1, 0]), (8, [2048, 2048])])
def test_triton_split_kv_decode_equals_reference(triton_interpreted, kv_lens, splits):
    """Split-KV (flash-decoding) decode, splits past a short sequence's end (nothing to read), an
    empty row (a graph's padding: zeros, not NaN); the same output as one split."""
    from vlinfer.ops.cuda.loader import load_triton_module
    attention = load_triton_module("paged_attention")
    q, k_cache, v_cache, cu, _, tables = make_batch([1] * len(kv_lens),
                                                    [max(n, 1) for n in kv_lens], 8, NUM_KV_HEADS,
                                                    64, 64, torch.bfloat16, extra_width=2)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    ours = attention.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125, splits=splits)
    whole = attention.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125, splits=1)
    live = lens > 0
    cu_live = torch.arange(int(live.sum()) + 1, dtype=torch.int32)
    ref = reference.paged_attention(
        *fp32((q[live], k_cache, v_cache, cu_live, lens[live], tables[live])), 0.125)
    assert rel_err_per_seq(ours[live], ref) < TOL[torch.bfloat16]
    assert rel_err_per_seq(ours[live], whole[live]) < TOL[torch.bfloat16]
    assert torch.isfinite(ours).all() and (ours[~live] == 0).all()


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_short_read_fails_the_per_sequence_tolerance(triton_interpreted, splits):
    """Negative control: the decode reading the longest of four sequences (1000 keys) one key, or
    one 64-key block, short fails the bf16 TOL per sequence; one batch-wide max let both through."""
    from vlinfer.ops.cuda.loader import load_triton_module
    module = load_triton_module("paged_attention")
    args = make_batch([1] * 4, [1, 40, 129, 1000], 4, NUM_KV_HEADS, 64, 64, torch.bfloat16)
    (key, key_wide), (block, block_wide) = short_reads(
        lambda *a: module.paged_attention(*a, splits=splits), args, 0.125, 64)
    assert key > TOL[torch.bfloat16] and block > TOL[torch.bfloat16]
    assert max(key_wide, block_wide) < TOL[torch.bfloat16]

# ---- TF32: the dots a GPU runs at TF32 on 16-bit models, which the interpreter runs exactly ----

# The Triton attention computes in float32 on every model: float32 models dot at "ieee", 16-bit
# ones at the default input_precision, TF32 on a GPU. The interpreter ignores input_precision
# (numpy float32 products): the branch is the GPU's, the rounding is not. Against the TF32
# reference (paged_batches.tf32_paged_attention) a GPU's 16-bit output differs by its rounding to
# the output dtype (unit roundoff: 2^-8 bf16, 2^-11 fp16), half a TF32 unit of each probability
# (2^-11, where the kernel's running maximum rounds it differently) and float32 accumulation
# (1e-5), per sequence: bf16 2^-8 + 2^-11 + 1e-5 < 4.5e-3, fp16 2^-10 + 1e-5 < 1e-3. The
# interpreter truncates float32 to bf16 (a whole unit, 2^-7; fp_downcast_rounding="rtne" is
# ignored there too, test_the_interpreter_still_truncates_to_bf16), so its bf16 bound is
# 2^-7 + 2^-11 + 1e-5 < 8.5e-3.
TF32_TOL = {torch.bfloat16: 4.5e-3, torch.float16: 1e-3}
INTERPRETED_TF32_TOL = {torch.bfloat16: 8.5e-3, torch.float16: 1e-3}
TF32_BATCHES = [SMALL_BATCH, ([1, 1], [600, 1])]  # prefill, prefix hits, decodes; a long decode


def tf32_errors(attention, dtype, device="cpu", drop_last_key=False):
    """Per-sequence errors of `attention` against the TF32 reference over TF32_BATCHES."""
    errors = []
    for q_lens, kv_lens in TF32_BATCHES:
        kv_lens = [max(n, 1) for n in kv_lens]
        args = make_batch(q_lens, kv_lens, NUM_KV_HEADS * 4, NUM_KV_HEADS, 128, 16, dtype,
                          seed=len(kv_lens))
        ref = tf32_paged_attention(*fp32(args), 128 ** -0.5)
        lens = args[4] - int(drop_last_key)  # the control: each sequence one key short
        ours = attention(*(a.to(device) for a in (*args[:4], lens, args[5])), 128 ** -0.5)
        errors.append(rel_err_per_seq(ours.cpu(), ref, args[3]))
    return errors


def test_tf32_rounds_the_mantissa_to_10_bits_to_nearest_even():
    one = torch.tensor([1.0, 1 + 2 ** -10, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -12), 3e-39])
    assert tf32(one).tolist() == [1.0, 1 + 2 ** -10, 1.0, 1 + 2 ** -9, -1.0, tf32(one)[5].item()]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert ((tf32(x) - x).abs() <= x.abs() * 2 ** -11).all() and (tf32(x) != x).any()
    assert (tf32(x.bfloat16().float()) == x.bfloat16().float()).all()  # bf16 is exact in TF32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_the_interpreted_16_bit_branch_is_within_the_tf32_bound(triton_interpreted, dtype):
    """Under the interpreter the 16-bit branch (no widening: the tiles are float32 already) runs
    with exact products, which lie within TF32_TOL of the TF32 reference too (the reference's
    roundings are inside the bound); each sequence one key short (a planted bug) is not."""
    from vlinfer.ops.cuda.loader import load_triton_module
    attention = load_triton_module("paged_attention").paged_attention
    assert max(tf32_errors(attention, dtype)) < INTERPRETED_TF32_TOL[dtype]
    assert min(tf32_errors(attention, dtype, drop_last_key=True)) > INTERPRETED_TF32_TOL[dtype]


def test_the_interpreter_still_truncates_to_bf16(triton_interpreted):
    """Why the interpreted bf16 bound is a whole bf16 unit: Triton's interpreter converts float32
    to bf16 toward zero, even when told to round to nearest (a GPU rounds to nearest). When a
    release fixes it, this fails: tighten INTERPRETED_TF32_TOL to TF32_TOL then."""
    import triton
    import triton.language as tl

    @triton.jit
    def to_bf16(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16, fp_downcast_rounding="rtne"))
    x = torch.tensor([1 + 0.99 * 2 ** -7, -2.0155, 2.9, 0.3])
    out = torch.empty(4, dtype=torch.bfloat16)
    to_bf16[(1, )](x, out, 4)
    assert (out.float().abs() < x.bfloat16().float().abs()).all()  # toward zero, not nearest


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton interpreter runs tl.dot's default "
                    "input_precision as exact float32 products, not TF32; bench/cuda_check.sh runs "
                    "this on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_gpu_16_bit_attention_is_within_the_tf32_bound(dtype):
    """On a GPU, the Triton attention of a 16-bit model (TF32 dots) against the TF32 reference
    within TF32_TOL per sequence."""
    from vlinfer.ops.cuda.loader import load_triton_module
    attention = load_triton_module("paged_attention").paged_attention
    assert max(tf32_errors(attention, dtype, device="cuda")) < TF32_TOL[dtype]


def test_triton_attention_splits_only_few_long_decodes():
    """The split count follows from shapes only (a CUDA graph captures it): decode steps with few
    (sequence, KV head) programs and a wide table split, a power of two up to MAX_SPLITS; prefill
    and big batches do not."""
    from vlinfer.ops.cuda.loader import load_triton_module
    module = load_triton_module("paged_attention")
    assert module.num_splits(4, 4, 2, 32, 128) == 8  # 4k-token table, 8 programs
    assert module.num_splits(1, 1, 8, 256, 128) == module.MAX_SPLITS  # 32k tokens
    assert module.num_splits(64, 64, 8, 16, 128) == 1  # 512 programs: the GPU is full already
    assert module.num_splits(9, 4, 2, 32, 128) == 1  # a prefill chunk in the step
    assert module.num_splits(2, 2, 2, 2, 128) == 1  # a short table


def test_triton_attention_takes_no_host_sync(triton_interpreted, monkeypatch):
    """The kernel's wrapper reads no tensor value on the host (meta tensors have none): the launch
    is captured whole, with the split-KV decode too."""
    from vlinfer.ops.cuda.loader import load_triton_module
    module = load_triton_module("paged_attention")
    launched = []
    monkeypatch.setattr(module, "_paged_attention_kernel", _Launcher(launched))
    monkeypatch.setattr(module, "_combine_splits", _Launcher(launched))
    args = [
        a.to("meta") for a in make_batch([1] * 4, [3, 4000, 17, 1], 8, 2, 64, 16, torch.bfloat16)
    ]
    out = module.paged_attention(*args, 0.125)
    assert out.shape == args[0].shape and [name for name, _ in launched] == ["launch", "launch"]
    assert launched[0][1][2] == module.num_splits(4, 4, 2, args[5].shape[1], 16) > 1


class _Launcher:
    """A stand-in for a @triton.jit kernel: kernel[grid](...) records the grid."""

    def __init__(self, launched):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(("launch", grid))


@pytest.mark.parametrize("dtype, head_dim, heads, seg", [
    (torch.float32, 64, 2, [16, 40, 1, 9]), (torch.bfloat16, 80, 3, [5, 33]),
    pytest.param(torch.float16, 72, 16, [16, 300, 1, 45, 64], marks=pytest.mark.slow)],
    ids=["fp32", "bf16", "fp16-long"])
def test_triton_varlen_attention_equals_reference(triton_interpreted, dtype, head_dim, heads, seg):
    """The vision tower's packed images and frames in one launch, bidirectional; the dispatch runs
    it where flash_attn is absent."""
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(sum(seg), heads, head_dim, generator=g).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(seg)], dtype=torch.int32)
    ours = triton_interpreted.varlen_attention(q, k, v, cu, head_dim ** -0.5)
    ref = reference.varlen_attention(q.float(), k.float(), v.float(), cu, head_dim ** -0.5)
    assert ours.dtype == dtype and rel_err_per_seq(ours, ref, cu) < TOL[dtype]


def test_an_engine_on_the_cuda_ops_runs_an_int8_cache_in_triton(triton_interpreted,
                                                                qwen3_checkpoint, caplog):
    """The whole engine on CudaOps (CPU tensors, kernels interpreted): the startup log names the
    Triton reader, and the logits equal the reference op table's with the same int8 cache."""
    from kv_cache_dtype_cases import path_logits
    from text_parity_cases import PROMPTS
    from vlinfer import LLM
    path, _ = qwen3_checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ours = LLM(path, dtype="float32", kv_cache_bytes=2 << 20, kv_cache_dtype="int8", ops="cuda",
                   kvcache_block_size=16)
    assert "KV cache in torch.int8: cuda kernels write it and read it" in caplog.text
    theirs = LLM(path, dtype="float32", kv_cache_bytes=2 << 20, kv_cache_dtype="int8",
                 ops="reference", kvcache_block_size=16)
    for a, b in zip(path_logits(ours, PROMPTS[:3]), path_logits(theirs, PROMPTS[:3])):
        assert rel_err(a, b) < 1e-4
