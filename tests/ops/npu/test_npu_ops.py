"""The NPU ops (vlinfer/ops/npu/backend.py) against the pure-torch reference on CPU tensors, through
the emulated torch_npu of tests/fakes/fake_torch_npu.py, plus the emulation catching calls the
documented contracts reject.

Tolerances: max |npu - reference| / max |reference| per sequence (attention; each op's whole
output otherwise), the reference evaluated in float32 on the same (rounded) inputs. float16 2e-3
and bfloat16 1e-2 are docs/npu-ops.md §3's NPU-vs-reference tolerances; float32 (norms, rotary,
SwiGLU only: FIA and the cache writes take fp16/bf16) 1e-5.
Cache writes must be exact."""
import itertools
import logging
import sys

import pytest
import torch

from paged_batches import fp32, make_batch, rel_err, rel_err_per_seq, short_reads
from fake_torch_npu import FakeNpuError, FakeTorchNpu, install, loaded
from vlinfer.ops import OPS, ReferenceOps, reference
from vlinfer.ops.select import select
from vlinfer.ops.npu import NpuOps
from vlinfer.ops.npu import host as npu
from vlinfer.ops.npu.graph import GraphCapture
from npu_ops_cases import BATCHES, DTYPE_IDS, HALF, NUM_KV_HEADS, TOL


# ---- paged attention ----

@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 8])
@pytest.mark.parametrize("path", ["tnd", "split"])
def test_paged_attention_matches_reference(monkeypatch, path, gqa, head_dim, dtype):
    # without TND + PA the load-time probe picks the split
    fake, ops = loaded(monkeypatch, tnd_paged=path == "tnd")
    assert ops.features["tnd_paged"] == (path == "tnd")
    scale = head_dim ** -0.5
    for seed, (q_lens, kv_lens) in enumerate(BATCHES):
        args = make_batch(q_lens, kv_lens, NUM_KV_HEADS * gqa, NUM_KV_HEADS, head_dim, 128, dtype,
                          seed)
        before = fake.calls["npu_fused_infer_attention_score"]
        out = ops.paged_attention(*args, scale)
        ref = reference.paged_attention(*fp32(args), scale)
        assert out.dtype == dtype and out.shape == args[0].shape
        assert rel_err_per_seq(out, ref, args[3]) < TOL[dtype], (q_lens, kv_lens)
        kinds = {n == 1 for n in q_lens}
        # split: one call for decodes, one for prefills
        expected = 1 if path == "tnd" else len(kinds)
        assert fake.calls["npu_fused_infer_attention_score"] - before == expected
        layout = fake.last["npu_fused_infer_attention_score"]["input_layout"]
        assert layout == ("TND" if path == "tnd" else "BSH")


@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
def test_block_size_16_serves_decodes_and_is_refused_for_prefill(monkeypatch, dtype):
    _, ops = loaded(monkeypatch)
    # FIA allows 16-aligned blocks when every query is one token (IFA), only multiples of 128
    # otherwise (§2.3).
    args = make_batch([1] * 5, [1, 15, 16, 17, 70], 4, NUM_KV_HEADS, 64, 16, dtype)
    out = ops.paged_attention(*args, 0.125)
    assert rel_err_per_seq(out, reference.paged_attention(*fp32(args), 0.125)) < TOL[dtype]
    args = make_batch([1, 20], [30, 20], 4, NUM_KV_HEADS, 64, 16, dtype)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.paged_attention(*args, 0.125)


@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("path", ["tnd", "split"])
def test_a_short_read_fails_the_per_sequence_tolerance(monkeypatch, path, dtype):
    """Negative control: FIA reading the longest decode one key or one block short (planted through
    its kv lengths) fails TOL per sequence, where one batch-wide max let such bugs through."""
    _, ops = loaded(monkeypatch, tnd_paged=path == "tnd")
    args = make_batch([1] * 4, [1, 40, 129, 1000], 4, NUM_KV_HEADS, 128, 128, dtype)
    (key, key_batch_wide), (block, _) = short_reads(ops.paged_attention, args, 128 ** -0.5, 128)
    assert key > TOL[dtype] and block > TOL[dtype]
    assert key_batch_wide < TOL[dtype]  # what the batch-wide max let through

def test_metadata_is_read_once_per_step(monkeypatch):
    _, ops = loaded(monkeypatch)
    args = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, 128, torch.float16)
    ops.paged_attention(*args, 0.125)
    meta = ops._attention_step._value
    ops.paged_attention(*args, 0.125)  # the next layer: same tensors, same host lists
    assert ops._attention_step._value is meta
    q, k, v, cu, seq_lens, tables = args
    # the next step
    ops.paged_attention(q, k, v, cu.clone(), seq_lens.clone(), tables.clone(), 0.125)
    assert ops._attention_step._value is not meta


def test_two_instances_keep_their_own_state(monkeypatch, caplog):
    """Two engines' op tables in one process: each keeps the torch_npu it loaded, what it detected,
    its per-step metadata, its warnings and its graph capture."""
    fake_a, a = loaded(monkeypatch)  # TND over the paged cache
    # made later on another release: must not change `a`
    fake_b, b = loaded(monkeypatch, tnd_paged=False)
    assert a.features["tnd_paged"] and not b.features["tnd_paged"]
    step_a = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, 128, torch.float16, 1)
    step_b = make_batch(*BATCHES[0], 4, NUM_KV_HEADS, 64, 128, torch.float16, 2)
    metas = {}
    for layer in range(3):  # the two engines' steps interleaved, layer after layer
        for name, ops, fake, args, layout in (("a", a, fake_a, step_a, "TND"), ("b", b, fake_b,
                                                                                step_b, "BSH")):
            before = fake_a.calls["npu_fused_infer_attention_score"], fake_b.calls[
                "npu_fused_infer_attention_score"]
            out = ops.paged_attention(*args, 0.125)
            assert rel_err_per_seq(out, reference.paged_attention(*fp32(args), 0.125),
                                  args[3]) < TOL[torch.float16]
            assert fake.last["npu_fused_infer_attention_score"]["input_layout"] == layout
            after = fake_a.calls["npu_fused_infer_attention_score"], fake_b.calls[
                "npu_fused_infer_attention_score"]
            # the other engine's torch_npu was not called
            assert after[name == "a"] == before[name == "a"]
            # Each instance builds its step's host metadata once, whatever the other engine ran in
            # between.
            meta = ops._attention_step._value
            assert metas.setdefault(name, meta) is meta
    assert metas["a"] is not metas["b"] and metas["a"].kv_lens == BATCHES[2][1]

    # Warnings once per engine; a capture on one leaves the other eager (it reads host lengths as
    # usual).
    args32 = make_batch(*BATCHES[0], 4, NUM_KV_HEADS, 64, 128, torch.float32)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        for ops in (a, b, a, b):
            ops.paged_attention(*args32, 0.125)
    assert caplog.text.count("paged_attention on torch.float32 runs the pure-torch reference") == 2
    with a._capturing(GraphCapture([1, 2])):
        with pytest.raises(RuntimeError, match="cannot be captured"):
            a.paged_attention(*args32, 0.125)
        out = b.paged_attention(*step_a, 0.125)  # a mixed batch: eager, not a captured decode
        assert rel_err_per_seq(out, reference.paged_attention(*fp32(step_a), 0.125),
                               step_a[3]) < TOL[torch.float16]
    assert a._capture is None and b._capture is None


def test_float32_attention_and_cache_write_run_the_reference(monkeypatch, caplog):
    fake, ops = loaded(monkeypatch)
    args = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, 128, torch.float32)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        out = ops.paged_attention(*args, 0.125)
        assert torch.equal(out, reference.paged_attention(*args, 0.125))
        ops.paged_attention(*args, 0.125)
        q, k_cache, v_cache, *_ = args
        slots = torch.arange(q.shape[0])
        ops.store_kvcache(q[:, :NUM_KV_HEADS], q[:, :NUM_KV_HEADS], k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, 64)[:q.shape[0]], q[:, :NUM_KV_HEADS])
    assert caplog.text.count("paged_attention on torch.float32 runs the pure-torch reference") == 1
    assert "store_kvcache on torch.float32 runs the pure-torch reference" in caplog.text
    assert fake.calls["npu_fused_infer_attention_score"] == 1  # the load-time probe only


# ---- KV cache write ----

@pytest.mark.parametrize("op", ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"])
@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_store_kvcache_matches_reference(monkeypatch, op, dtype, head_dim, num_kv_heads):
    fake, ops = loaded(monkeypatch, scatter_pa=op == "npu_scatter_pa_kv_cache")
    assert ops.features["cache_write"] == op
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, n = 6, 128, 300
    # A strided value, as the attention layer passes it (a view of the fused qkv projection), and
    # padding slots.
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[[3, 77]] = -1
    qkv = torch.randn(n, 3, num_kv_heads, head_dim, generator=g).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    caches = [torch.zeros(num_blocks, bs, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    ops.store_kvcache(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert fake.calls[op] == 2  # the probe's write, then this one
    if op == "npu_scatter_pa_kv_cache":
        assert fake.last[op] == {"cache_mode": "Norm"}


# ---- rotary, norms, SwiGLU ----

def rope_tables(positions, head_dim, scaling=1.0, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos() * scaling, emb.sin() * scaling


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 8])
def test_apply_rotary_matches_reference(monkeypatch, dtype, head_dim, gqa):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(2)
    t = 37
    q = torch.randn(t, NUM_KV_HEADS * gqa, head_dim, generator=g).to(dtype)
    k = torch.randn(t, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    # Random positions; 1.25 is a yarn-like attention scaling that takes the tables outside
    # npu_rotary_mul's [-1, 1].
    for scaling in (1.0, 1.25):
        cos, sin = rope_tables(torch.randint(0, 4096, (t,), generator=g), head_dim, scaling)
        q_out, k_out = ops.apply_rotary(q, k, cos, sin)
        q_ref, k_ref = reference.apply_rotary(q, k, cos, sin)
        assert q_out.dtype == dtype and k_out.dtype == dtype
        assert rel_err(q_out, q_ref) < TOL[dtype] and rel_err(k_out, k_ref) < TOL[dtype]
    assert fake.calls["npu_rotary_mul"] == 2  # one call over q and k together


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=DTYPE_IDS.get)
def test_norms_and_swiglu_match_reference(monkeypatch, dtype):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 256, generator=g).to(dtype)
    residual = torch.randn(19, 256, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    # bf16/fp16: the reference rounds x / rms before multiplying by the weight (as transformers
    # does); the fused op rounds once at the end, so they may differ by a unit in the last place.
    assert rel_err(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)) < TOL[dtype]
    heads = x.view(19, 4, 64)  # q_norm / k_norm: per head, gamma [head_dim]
    assert rel_err(ops.rms_norm(heads, weight[:64], 1e-6),
                   reference.rms_norm(heads, weight[:64], 1e-6)) < TOL[dtype]
    y, res = ops.add_rms_norm(x, residual, weight, 1e-6)
    y_ref, res_ref = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert rel_err(y, y_ref) < TOL[dtype] and torch.equal(res, res_ref)
    gate_up = torch.randn(19, 2 * 96, generator=g).to(dtype)
    assert rel_err(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)) < TOL[dtype]
    assert fake.calls["npu_rms_norm"] == 2 and fake.calls["npu_add_rms_norm"] == 1 and fake.calls[
        "npu_swiglu"] == 1


# ---- vision tower varlen attention ----

@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_varlen_attention_matches_reference(monkeypatch, dtype, head_dim):
    fake, ops = loaded(monkeypatch)
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 16, 80, 84, 340], dtype=torch.int32)
    q, k, v = (torch.randn(340, 4, head_dim, generator=g).to(dtype) for _ in range(3))
    out = ops.varlen_attention(q, k, v, cu, head_dim ** -0.5)
    ref = reference.varlen_attention(q.float(), k.float(), v.float(), cu, head_dim ** -0.5)
    assert out.shape == q.shape and rel_err_per_seq(out, ref, cu) < TOL[dtype]
    call = fake.last["npu_fused_infer_attention_score"]
    assert call["input_layout"] == "TND" and call["sparse_mode"] == 0 and "atten_mask" not in call
    assert call["actual_seq_lengths"] == call["actual_seq_lengths_kv"] == [16, 80, 84, 340]


def test_varlen_attention_float32_runs_the_reference(monkeypatch):
    _, ops = loaded(monkeypatch)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    assert torch.equal(ops.varlen_attention(q, k, v, cu, 0.25),
                       reference.varlen_attention(q, k, v, cu, 0.25))


# ---- feature detection and dispatch ----

def test_load_detects_the_2_14_contracts(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        _, ops = loaded(monkeypatch)
    assert ops.features == {
        "fia_scale_kwarg": "scale", "cache_write": "npu_scatter_pa_kv_cache", "tnd_paged": True
    }
    assert "ops: npu forced on device type cpu" in caplog.text
    assert ("cache write npu_scatter_pa_kv_cache, FIA scale keyword 'scale', attention one TND call"
            in caplog.text)
    assert ops.name == "npu" and ops.device_type == "cpu"
    # Every op the NPU has a fused operator for; linear and the GELU stay torch's (one aclnn op each
    # already), and so do the GGUF block ops (dequantize + matmul: GGUF files are a CPU format). A
    # compressed KV cache (kv_cache_dtype) is int8 on torch_npu
    # (tests/ops/npu/test_npu_kv_cache.py), checked on first use, not at load. The linears' packing,
    # the fused decode stack, LoRA's own slot layout and the token bitmask stay the reference's too
    # (plain weights, module by module, plain slots, torch ops). Linear attention (hybrid models):
    # the gated delta rule on torch_npu's ops, its conv (routed through NpuOps to log why) and
    # gated norm on the reference (npu-ops.md §7.9).
    on_torch = {"linear", "gelu_tanh", "gguf_linear", "gguf_embedding", "pack_gguf_weight",
                "pack_linear_weight", "dense_decode_stack", "pack_lora", "repack_lora",
                "apply_token_bitmask", "gated_rms_norm"}
    assert {op
            for op in OPS
            if getattr(NpuOps, op) is not getattr(ReferenceOps, op)} == set(OPS) - on_torch
    assert ops.rms_norm.__func__ is NpuOps.rms_norm
    assert ops.linear is reference.linear and ops.gelu_tanh is reference.gelu_tanh


@pytest.mark.parametrize("opaque", [False, "schema", True], ids=["signature", "schema", "opaque"])
@pytest.mark.parametrize("kwarg", ["scale", "scale_value"])
def test_fia_scale_keyword_is_detected(monkeypatch, caplog, kwarg, opaque):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        fake, ops = loaded(monkeypatch, fia_scale_kwarg=kwarg, opaque=opaque)
    assert ops.features["fia_scale_kwarg"] == kwarg
    # Names unreadable from signature and schema: the probe's first call decides.
    assert ("found by trying" in caplog.text) == (opaque is True)
    args = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, 128, torch.bfloat16)
    out = ops.paged_attention(*args, 0.125)
    assert rel_err_per_seq(out, reference.paged_attention(*fp32(args), 0.125),
                           args[3]) < TOL[torch.bfloat16]
    assert fake.last["npu_fused_infer_attention_score"][kwarg] == 0.125


def test_missing_tnd_paged_support_falls_back_to_split_calls(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        _, ops = loaded(monkeypatch, tnd_paged=False)
    assert ops.features["tnd_paged"] is False
    assert ("FIA in TND layout over the paged cache failed (FakeNpuError: TND does not support PA"
            in caplog.text)
    assert "attention split: BSH decode call + BSH prefill call" in caplog.text


def test_without_any_cache_write_op_npu_cannot_load(monkeypatch, caplog):
    # ATB listed but NNAL not sourced: OSError on first use
    install(monkeypatch, scatter_pa=False, atb=False)
    with pytest.raises(OSError, match="NNAL"):
        select("cpu")  # forced: an error, not a silent fallback
    monkeypatch.delenv("VLINFER_OPS")
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert type(select("npu")) is ReferenceOps
    # no "npu" device here: fails even earlier
    assert "torch_npu kernels unavailable (" in caplog.text


def test_npu_device_without_torch_npu_runs_the_reference(monkeypatch, caplog):
    install(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    monkeypatch.delenv("VLINFER_OPS")
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert type(select("npu")) is ReferenceOps
    assert "torch_npu kernels unavailable (ModuleNotFoundError" in caplog.text


def test_override_values(monkeypatch, caplog):
    install(monkeypatch)
    monkeypatch.setenv("VLINFER_OPS", "reference")
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        ops = select("npu")
    assert type(ops) is ReferenceOps and ops.device_type == "npu"
    assert "ops: reference forced on device type npu" in caplog.text
    # an explicit choice wins over the environment
    assert type(select("cpu", forced="npu")) is NpuOps
    monkeypatch.setenv("VLINFER_OPS", "tpu")
    with pytest.raises(ValueError, match="expected one of cuda, npu, cpu-compiled, reference"):
        select("cpu")


# ---- the emulation rejects calls the contracts forbid ----

def fia_call(**changes):
    """A valid TND + paged FIA call (mixed batch, block size 128, int8 2048^2 causal mask) with
    changes applied."""
    q, k_cache, v_cache, cu, seq_lens, tables = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, 128,
                                                           torch.float16)
    nb = k_cache.shape[0]
    kwargs = dict(atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1),
                  actual_seq_lengths=cu[1:].tolist(), actual_seq_lengths_kv=seq_lens.tolist(),
                  block_table=tables, num_heads=4, num_key_value_heads=NUM_KV_HEADS,
                  input_layout="TND", sparse_mode=3, block_size=128, scale=0.125)
    args = [q, k_cache.view(nb, 128, -1), v_cache.view(nb, 128, -1)]
    kwargs.update(changes)
    for i, name in enumerate(("query", "key", "value")):
        if name in kwargs:
            args[i] = kwargs.pop(name)
    return args, kwargs, (q, k_cache, v_cache, cu, seq_lens, tables)


def test_valid_fia_call_matches_reference():
    args, kwargs, batch = fia_call()
    out, lse = FakeTorchNpu().npu_fused_infer_attention_score(*args, **kwargs)
    assert lse.shape == (1,)
    assert rel_err_per_seq(out, reference.paged_attention(*fp32(batch), 0.125),
                           batch[3]) < TOL[torch.float16]


def _noncontiguous(q):
    return q.transpose(0, 1).contiguous().transpose(0, 1)


WRONG_FIA_CALLS = {
    "layout-THD": (dict(input_layout="THD"), "input_layout"),
    "layout-BSH-with-TND-query": (dict(input_layout="BSH",
                                       actual_seq_lengths=None), "block_table must be"),
    "sparse-mode-5": (dict(sparse_mode=5), "not implemented"),
    "sparse-mode-9": (dict(sparse_mode=9), "MLA-only"),
    "sparse-3-without-mask": (dict(atten_mask=None), "needs the compressed"),
    "mask-tril-not-triu": (dict(atten_mask=torch.tril(torch.ones(2048, 2048, dtype=torch.int8))),
                           "pattern"),
    "mask-sized-to-sequence": (dict(
        atten_mask=torch.triu(torch.ones(300, 300, dtype=torch.bool), 1)), "2048"),
    "mask-float": (dict(atten_mask=torch.triu(torch.ones(2048, 2048), 1)), "bool/int8/uint8"),
    "block-size-kwarg-mismatch": (dict(block_size=256), "cache's block size is 128"),
    "block-size-missing": (dict(block_size=0), "cache's block size"),
    "q-lengths-as-tensor": (dict(actual_seq_lengths=torch.tensor([7, 8])), "SymInt"),
    "q-lengths-per-batch": (dict(actual_seq_lengths=[7, 1, 130, 1, 40, 3]), "non-decreasing"),
    "q-offsets-short-of-T": (dict(actual_seq_lengths=[7, 8, 138, 139, 179, 180]), "561002"),
    "kv-lengths-missing": (dict(actual_seq_lengths_kv=None), "needs actual_seq_lengths_kv"),
    "kv-lengths-cumulative": (dict(
        actual_seq_lengths_kv=list(itertools.accumulate([7, 200, 130, 129, 300, 131]))), "outside"),
    "block-table-int64": ("int64-table", "int32"),
    "block-table-bad-id": ("bad-id", "outside"),
    "float32": ("fp32", "float16 or bfloat16"),
    "noncontiguous-query": ("noncontiguous", "not contiguous"),
    "heads-not-multiple": (dict(num_heads=4,
                                num_key_value_heads=3), "multiple of num_key_value_heads"),
    "scale-value-keyword-on-2.14": (dict(scale_value=0.125), "unexpected keyword"),
}


@pytest.mark.parametrize("case", list(WRONG_FIA_CALLS))
def test_fia_emulation_rejects(case):
    change, message = WRONG_FIA_CALLS[case]
    args, kwargs, _ = fia_call(**(change if isinstance(change, dict) else {}))
    if case == "scale-value-keyword-on-2.14":
        kwargs.pop("scale")
    if change == "int64-table":
        kwargs["block_table"] = kwargs["block_table"].long()
    elif change == "bad-id":
        kwargs["block_table"] = kwargs["block_table"].clone()
        kwargs["block_table"][2, 1] = -1  # the second block of a 130-token sequence
    elif change == "fp32":
        args = [a.float() for a in args]
    elif change == "noncontiguous":
        args[0] = _noncontiguous(args[0])
    with pytest.raises((FakeNpuError, TypeError), match=message):
        FakeTorchNpu().npu_fused_infer_attention_score(*args, **kwargs)


def test_fia_emulation_rejects_block_size_16_for_prefill_only():
    fake = FakeTorchNpu()
    for q_lens, ok in (([1, 1], True), ([1, 5], False)):
        q, k_cache, v_cache, cu, seq_lens, tables = make_batch(q_lens, [20, 40], 4, NUM_KV_HEADS,
                                                               64, 16, torch.float16)
        nb = k_cache.shape[0]
        call = lambda: fake.npu_fused_infer_attention_score(  # noqa: E731
            q, k_cache.view(nb, 16, -1), v_cache.view(
                nb, 16, -1), atten_mask=npu.causal_mask(q.device), actual_seq_lengths=cu[1:].tolist(
                ), actual_seq_lengths_kv=seq_lens.tolist(), block_table=tables, num_heads=4,
            num_key_value_heads=NUM_KV_HEADS, input_layout="TND", sparse_mode=3, block_size=16)
        if ok:
            call()
        else:
            with pytest.raises(FakeNpuError, match="multiple of 128"):
                call()


def test_cache_write_emulation_rejects():
    fake = FakeTorchNpu()
    key = torch.randn(4, 2, 64, dtype=torch.float16)
    cache = lambda dtype=torch.float16: torch.zeros(2, 128, 2, 64, dtype=dtype)  # noqa: E731
    slots = torch.tensor([0, 5, 130, 255])
    with pytest.raises(FakeNpuError, match="pass cache_mode='Norm'"):
        fake.npu_scatter_pa_kv_cache(key, key, cache(), cache(), slots)  # the default is PA_NZ
    with pytest.raises(FakeNpuError, match="duplicates"):
        fake.npu_scatter_pa_kv_cache(key, key, cache(), cache(), torch.tensor([0, 5, 5, 7]),
                                     cache_mode="Norm")
    with pytest.raises(FakeNpuError, match="out of"):
        fake.npu_scatter_pa_kv_cache(key, key, cache(), cache(), torch.tensor([0, 5, 256, 7]),
                                     cache_mode="Norm")
    with pytest.raises(FakeNpuError, match="float16|fp16"):
        fake.npu_scatter_pa_kv_cache(key.float(), key.float(), cache(torch.float32),
                                     cache(torch.float32), slots, cache_mode="Norm")
    with pytest.raises(FakeNpuError, match="contiguous"):
        strided = torch.randn(4, 3, 2, 64, dtype=torch.float16)[:, 1]
        fake.npu_scatter_pa_kv_cache(strided, key, cache(), cache(), slots, cache_mode="Norm")
    with pytest.raises(FakeNpuError, match="not documented as skipped"):
        fake._npu_reshape_and_cache(key, key, cache(), cache(),
                                    torch.tensor([0, -1, 3, 4], dtype=torch.int32))
    with pytest.raises(FakeNpuError, match="int32"):
        fake._npu_reshape_and_cache(key, key, cache(), cache(), slots)


def test_rotary_norm_swiglu_emulation_rejects():
    fake = FakeTorchNpu()
    x = torch.randn(1, 5, 3, 64)
    cos, sin = rope_tables(torch.arange(5), 64)
    r1, r2 = cos[None, :, None], sin[None, :, None]
    fake.npu_rotary_mul(x, r1, r2)
    with pytest.raises(FakeNpuError, match="full D"):
        fake.npu_rotary_mul(x, r1[..., :32], r2[..., :32])
    with pytest.raises(FakeNpuError, match="4-D"):
        fake.npu_rotary_mul(x[0], cos[:, None], sin[:, None])
    with pytest.raises(FakeNpuError, match=r"\[-1, 1\]"):
        fake.npu_rotary_mul(x, r1 * 1.5, r2 * 1.5)
    with pytest.raises(FakeNpuError, match="rotary_mode"):
        fake.npu_rotary_mul(x, r1, r2, rotary_mode="neox")
    with pytest.raises(FakeNpuError, match="gamma must have x's dtype"):
        fake.npu_rms_norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8))
    with pytest.raises(FakeNpuError, match="2-8 dims"):
        fake.npu_rms_norm(torch.randn(8), torch.ones(8))
    with pytest.raises(FakeNpuError, match="odd size"):
        fake.npu_swiglu(torch.randn(3, 7))
