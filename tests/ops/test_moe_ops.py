"""The fused MoE op's device implementations against its definition (vlinfer/ops/reference/moe.py):
the CPU one (CpuOps, ops/cpu/moe.py), the CUDA one (CudaOps: our Triton kernels under the Triton
interpreter, on CPU tensors) and the NPU one (NpuOps on the emulated torch_npu of
tests/fakes/fake_torch_npu_moe.py), over a sampled grid of tokens 1..512, experts 4..128, top-k
1..8, with experts that receive no tokens and the expert-parallel case (a rank holding experts
[offset, offset + E_local) of E_total). H differs from I and from 2I, so a transposed weight cannot
pass.

Tolerances: max |ours - reference| / max |reference|, the reference in float32 on the same (rounded)
inputs: float32 1e-5, bfloat16 2e-2 (bf16 rounds the expert outputs and the routing weights;
measured 4e-3..1e-2), float16 3e-3 (three more mantissa bits). The Triton interpreter runs each
program in Python: its shapes are small. It cannot run bf16 tl.dot, so there bf16 tiles are widened
to float32 (fp16 ones run as on a GPU); the unwidened bf16 branch has a GPU-only test."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fake_torch_npu import FakeNpuError, install
from vlinfer.platform import cpu_features
from vlinfer.ops.select import select
from vlinfer.ops.cpu import moe as cpu_moe
from vlinfer.ops.reference import moe as moe_reference
from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.cuda import CudaOps
from vlinfer.ops.npu import NpuOps

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

# (tokens, experts in total, top_k, hidden, moe intermediate, local experts, expert offset, routing)
# routing "skewed": the logits favour a few experts, so most experts get no tokens at all.
GRID = [
    (1, 4, 1, 64, 48, 4, 0, "random"),
    (5, 8, 2, 64, 48, 8, 0, "random"),
    (17, 16, 4, 32, 80, 16, 0, "skewed"),
    (64, 32, 8, 48, 32, 32, 0, "random"),
    (2, 128, 8, 32, 48, 128, 0, "random"),  # 16 pairs over 128 experts: most empty
    (130, 128, 8, 32, 48, 128, 0, "skewed"),
    (512, 64, 6, 32, 16, 64, 0, "random"),
    (300, 128, 8, 32, 48, 64, 64, "random"),  # expert parallel: the second half
    (9, 16, 3, 32, 48, 4, 6, "random"),  # expert parallel: a middle slice, most pairs elsewhere
    (3, 16, 1, 32, 48, 4, 12, "skewed"),  # expert parallel: possibly no local pair at all
]
# The Triton interpreter's share: every feature above, at sizes it runs in seconds.
TRITON_GRID = [
    (1, 4, 1, 32, 48, 4, 0, "random"),
    (6, 8, 2, 32, 48, 8, 0, "random"),
    (2, 128, 8, 32, 16, 128, 0, "random"),
    (24, 16, 4, 32, 16, 16, 0, "skewed"),
    (7, 16, 3, 32, 48, 6, 5, "random"),
]


def case_id(case):
    t, e, k, h, i, local, offset, routing = case
    ep = f"-ep{offset}+{local}" if local != e else ""
    return f"t{t}-e{e}-k{k}-h{h}-i{i}{ep}-{routing}"


def make_case(case, dtype, seed=0):
    t, e, k, h, i, local, offset, routing = case
    g = torch.Generator().manual_seed(seed + t * 131 + e)
    x = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if routing == "skewed":  # three favourites take nearly every slot
        logits[:, torch.randperm(e, generator=g)[:max(k, 3)]] += 8.0
    w13 = (torch.randn(local, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(local, h, i, generator=g) / i ** 0.5).to(dtype)
    return x, logits.to(dtype), w13, w2, k, True, offset


def rel_err(ours, expected):
    scale = expected.abs().max()
    if scale == 0:
        return ours.abs().max().item()
    return ((ours.float() - expected).abs().max() / scale).item()


def check(ops, case, dtype, packed=False):
    """ops.fused_moe against the reference; packed: on the weights in ops.pack_moe_weights' layout.
    """
    x, logits, w13, w2, k, renorm, offset = make_case(case, dtype)
    expected = moe_reference.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), k,
                                       renorm, offset)
    if packed:
        w13, w2 = ops.pack_moe_weights(w13, w2) or (w13, w2)
    ours = ops.fused_moe(x, logits, w13, w2, k, renorm, offset)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert not ours.isnan().any()
    assert rel_err(ours, expected) < TOL[dtype], case_id(case)
    return expected


@pytest.fixture(scope="module")
def cpu_ops():
    return CpuOps()


@pytest.fixture(scope="module")
def cuda_ops():
    """CudaOps on CPU tensors with the Triton kernels interpreted (TRITON_INTERPRET=1 when they
    load)."""
    import triton  # noqa: F401  (a test dependency: a missing one fails here)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setitem(sys.modules, "flash_attn", None)
        ops = CudaOps("cpu")
        assert ops._moe_kernel(
        ) is not None and ops.features["moe"] == "triton", "the kernels failed their check"
    return ops


@pytest.fixture(scope="module")
def npu_env():
    """(the emulated torch_npu, an NpuOps on it), as an engine on CPU tensors would select it."""
    with pytest.MonkeyPatch.context() as mp:
        fake = install(mp)
        ops = select("cpu")
        assert type(ops) is NpuOps
        yield fake, ops


# ---- every implementation equals the reference ----

@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_cpu_fused_moe_equals_reference(cpu_ops, case):
    """On the weights as loaded and on what pack_moe_weights made of them (bf16 panels where this
    CPU takes them)."""
    check(cpu_ops, case, torch.float32)
    check(cpu_ops, case, torch.float32, packed=True)
    if case[0] <= 130:
        check(cpu_ops, case, torch.bfloat16)
    check(cpu_ops, case, torch.bfloat16, packed=True)


def test_cpu_panels_run_every_group_size(cpu_ops, monkeypatch):
    """Panel-packed bf16 experts (AVX512-BF16 without AMX) run expert_panel_matmul for both
    projections at every group size, decode to prefill; a float32 call on them is refused by name.
    """
    if not cpu_ops.moe_panels:
        assert not cpu_ops.ext.expert_panels_available() or "amx_bf16" in cpu_features.cpu_flags()
        pytest.skip("needs AVX512-BF16 without AMX: MoE experts take no panels on this CPU")
    calls = []
    kernel = cpu_ops.ext.expert_panel_matmul
    monkeypatch.setattr(cpu_ops.ext, "expert_panel_matmul",
                        lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for tokens in (1, 12, 200):
        case = (tokens, 8, 2, 64, 48, 8, 0, "random")
        calls.clear()
        check(cpu_ops, case, torch.bfloat16, packed=True)
        assert calls == [tokens * 2] * 2
    x, logits, w13, w2, k, renorm, offset = make_case(GRID[1], torch.bfloat16)
    p13, p2 = cpu_ops.pack_moe_weights(w13, w2)
    assert p13.dim() == 5 and p13.shape[3:] == (32, 2)
    with pytest.raises(ValueError, match="panel-packed experts run only in bfloat16"):
        cpu_ops.fused_moe(x.float(), logits.float(), p13, p2, k, renorm, offset)


@pytest.mark.parametrize("tokens, dtype, takes_kernel", [(2, torch.bfloat16, True),
                                                         (12, torch.bfloat16, True),
                                                         (200, torch.bfloat16, False),
                                                         (2, torch.float32, False)],
                         ids=["decode-bf16", "small-batch-bf16", "prefill-bf16", "decode-fp32"])
def test_cpu_small_groups_run_the_expert_kernel(cpu_ops, tokens, dtype, takes_kernel):
    """bf16 steps with at most cpu_moe.SMALL_GROUP_ROWS rows per active expert run expert_matmul
    (both projections), the rest torch's grouped GEMM; the result equals the reference either way.
    """
    calls = []

    def spy(rows, w, offs):
        calls.append(rows.shape[0])
        return cpu_ops.ext.expert_matmul(rows, w, offs)

    x, logits, w13, w2, k, renorm, offset = make_case((tokens, 64, 8, 64, 48, 64, 0, "random"),
                                                      dtype)
    expected = moe_reference.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), k,
                                       renorm, offset)
    ours = cpu_moe.fused_moe(x, logits, w13, w2, k, renorm, offset, cpu_ops.silu_and_mul, spy)
    assert calls == ([tokens * k] * 2 if takes_kernel else [])
    assert rel_err(ours, expected) < TOL[dtype]


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_npu_fused_moe_equals_reference(npu_env, case):
    fake, ops = npu_env
    before = fake.calls["npu_grouped_matmul"]
    check(ops, case, torch.float32)
    if case[0] <= 130:
        check(ops, case, torch.bfloat16)
    assert fake.calls["npu_grouped_matmul"] - before == (4 if case[0] <= 130 else 2)  # two per call
    routing = fake.last["npu_moe_init_routing_v2"]
    _, e, k, _, _, local, offset, _ = case
    assert routing["active_expert_range"] == [offset, offset + local] and routing["expert_num"] == e
    assert fake.last["npu_moe_finalize_routing"]["drop_pad_mode"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", TRITON_GRID, ids=case_id)
def test_triton_fused_moe_equals_reference(cuda_ops, case, dtype):
    check(cuda_ops, case, dtype)


def test_the_interpreter_still_cannot_dot_bf16(monkeypatch):
    """Why fused_moe.py and lora.py widen bf16 tiles (only those) under the interpreter: its tl.dot
    is wrong on bf16 operands and right on fp16 ones. When a Triton release fixes bf16, this fails:
    drop the widening then, so the interpreter runs the GPU's branch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated, below
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, b_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        out = tl.dot(a, b, tl.full((M, N), 0.0, tl.float32))
        tl.store(o_ptr + m[:, None] * N + n[None, :], out)
    g = torch.Generator().manual_seed(0)
    errors = {}
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(16, 32, generator=g).to(dtype)
        b = torch.randn(32, 16, generator=g).to(dtype)
        out = torch.empty(16, 16)
        dot[(1, )](a, b, out, 16, 16, 32)
        exact = a.float() @ b.float()
        errors[dtype] = rel_err(out, exact)
    assert errors[torch.float16] < 1e-5 and errors[torch.bfloat16] > 1.0, errors


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton interpreter cannot run bf16 tl.dot, so on "
                    "CPU tensors bf16 tiles are widened to float32; the unwidened branch runs on a "
                    "GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_fused_moe_on_16_bit_tiles_equals_reference(dtype):
    ops = CudaOps("cuda")
    for case in TRITON_GRID:
        x, logits, w13, w2, k, renorm, offset = make_case(case, dtype)
        expected = moe_reference.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), k,
                                           renorm, offset)
        ours = ops.fused_moe(x.cuda(), logits.cuda(), w13.cuda(), w2.cuda(), k, renorm, offset)
        assert rel_err(ours.cpu(), expected) < TOL[dtype], case_id(case)


def test_grid_has_empty_experts_and_remote_pairs():
    """The grid covers what it claims: local experts with no pair, and pairs routed to another rank.
    """
    empty = remote = 0
    for case in GRID + TRITON_GRID:
        x, logits, w13, w2, k, _, offset = make_case(case, torch.float32)
        ids = moe_reference.route(logits, k, True, torch.float32)[1] - offset
        local = ids[(ids >= 0) & (ids < w13.shape[0])]
        empty += local.unique().numel() < w13.shape[0]
        remote += local.numel() < ids.numel()
    assert empty >= 6 and remote >= 3


# ---- the Triton design: alignment, graph safety, block sizes ----

def test_align_block_size_pads_each_expert_to_its_blocks():
    from vlinfer.ops.cuda import moe as cuda_moe
    kernel = cuda_moe.load_kernel()
    # local experts 0..2 at offset 0 of 6: expert 5 is remote
    ids = torch.tensor([[2, 0], [2, 5], [1, 2]])
    sorted_ids, experts, padded = kernel.align_block_size(ids, 4, 3, 0)
    n = ids.numel()
    assert padded.tolist() == [4 * 4]  # experts 0, 1, 2 and the remote group, one block each
    groups = sorted_ids[:16].view(4, 4).tolist()
    assert groups == [[1, n, n, n], [4, n, n, n], [0, 2, 5, n], [3, n, n, n]]
    assert experts[:4].tolist() == [0, 1, 2, -1]
    assert sorted_ids.numel() % 4 == 0 and (sorted_ids[16:] == n).all()


class NoHostSync(TorchDispatchMode):
    """Raises on an aten op a CUDA graph cannot capture: one that returns a host value (.item(),
    .tolist(), bool()) or whose output shape depends on tensor values."""
    DATA_DEPENDENT = {
        "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
        "aten::bincount", "aten::unique_consecutive", "aten::repeat_interleave",
        "aten::_local_scalar_dense"
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.DATA_DEPENDENT or any("Tensor" not in str(r.type)
                                              for r in func._schema.returns):
            raise AssertionError(f"{name}: a device->host sync")
        if name in ("aten::index", "aten::index_put_") and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1]):
            raise AssertionError(f"{name} with a boolean mask: a data-dependent shape")
        return func(*args, **(kwargs or {}))


def test_triton_alignment_takes_no_host_sync():
    """Routing and alignment read nothing back and their sizes come from shapes, and the launches'
    grids come from those sizes: a CUDA graph can capture the op. (Under the interpreter the kernels
    themselves run on the host.)"""
    from vlinfer.ops.cuda import moe as cuda_moe
    kernel = cuda_moe.load_kernel()
    logits = torch.randn(5, 16)
    with NoHostSync():
        _, ids = moe_reference.route(logits, 4, True, torch.bfloat16)
        sorted_ids, experts, padded = kernel.align_block_size(ids, 16, 8, 4)
    # 20 pairs, <= 9 groups, to 16s
    assert sorted_ids.shape == (20 + 9 * 15 + 5,) and experts.shape == (10,)


def test_block_config_grows_with_pairs_per_expert():
    from vlinfer.ops.cuda import moe as cuda_moe
    kernel = cuda_moe.load_kernel()
    assert kernel.block_config(8, 128, 2048, 768)["BLOCK_M"] == 16  # a decode step of one sequence
    assert kernel.block_config(8 * 4096, 128, 2048, 768)["BLOCK_M"] == 64  # prefill


def test_triton_missing_is_a_warning_and_the_reference(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    ops = CudaOps("cpu")
    with caplog.at_level("WARNING", logger="vlinfer"):
        assert ops.pack_moe_weights(torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)) is None
    assert ops.features["moe"] == "reference" and "Triton fused MoE unavailable" in caplog.text
    case = GRID[1]
    check(ops, case, torch.float32)


# ---- the NPU wiring: graph capture, the emulation's teeth ----

def test_npu_fused_moe_captures_in_a_graph(npu_env):
    """Nothing reads a value back to the host: the op records into an (emulated) ACL graph, and
    replays on new inputs written into the captured tensors give the reference's answer."""
    fake, ops = npu_env
    # expert parallel: the masking and padding are captured too
    case = (6, 16, 4, 32, 48, 8, 8, "random")
    x, logits, w13, w2, k, renorm, offset = make_case(case, torch.bfloat16)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = ops.fused_moe(x, logits, w13, w2, k, renorm, offset)
    for seed in (1, 2):
        new_x, new_logits = make_case(case, torch.bfloat16, seed=seed)[:2]
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        expected = moe_reference.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), k,
                                           renorm, offset)
        assert rel_err(out, expected) < TOL[torch.bfloat16]


def test_fake_npu_moe_ops_reject_what_the_pages_reject(npu_env):
    fake, _ = npu_env
    x = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 2]], dtype=torch.int32)
    common = dict(active_num=8, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                  active_expert_range=[0, 4])
    with pytest.raises(FakeNpuError, match="quant_mode"):
        fake.npu_moe_init_routing_v2(x, ids, **common)  # the default quant_mode 0 is not supported
    with pytest.raises(FakeNpuError, match="int32"):
        fake.npu_moe_init_routing_v2(x, ids.long(), quant_mode=-1, **common)
    rows, src_to_dst, counts, _ = fake.npu_moe_init_routing_v2(x, ids, quant_mode=-1, **common)
    assert counts.tolist() == [2, 2, 3, 1] and torch.equal(rows[src_to_dst.long()],
                                                           x.repeat_interleave(2, 0))
    w = torch.randn(4, 16, 8)
    with pytest.raises(FakeNpuError, match="add up to"):
        fake.npu_grouped_matmul([rows], [w], group_list=counts - 1, split_item=2, group_type=0,
                                group_list_type=1)
    with pytest.raises(FakeNpuError, match="strides"):
        fake.npu_grouped_matmul([rows], [w.permute(0, 2, 1).contiguous().permute(1, 2, 0)[:4]],
                                group_list=counts, split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(FakeNpuError, match="lie in"):
        fake.npu_moe_finalize_routing(rows, None, None, None, torch.ones(4, 2), src_to_dst - 1,
                                      None, drop_pad_mode=2)
    # Expert parallel: rows past the local pairs are invalid (NaN here), remote pairs' row index is
    # -1.
    rows, src_to_dst, counts, _ = fake.npu_moe_init_routing_v2(x, ids, quant_mode=-1, **{
        **common, "active_expert_range": [1, 3]})
    assert counts.tolist() == [2, 3] and rows[5:].isnan().all() and (src_to_dst < 0).sum() == 3


def test_bad_shapes_raise_clear_errors(cpu_ops, cuda_ops, npu_env):
    x, logits, w13, w2, k, renorm, offset = make_case(GRID[1], torch.float32)
    for ops in (cpu_ops, cuda_ops, npu_env[1]):
        with pytest.raises(ValueError, match="do not fit"):
            ops.fused_moe(x, logits, w13, w2[:, :, :-1], k, renorm, offset)
        with pytest.raises(ValueError, match="top_k"):
            ops.fused_moe(x, logits, w13, w2, 9, renorm, offset)
        with pytest.raises(ValueError, match="outside"):
            ops.fused_moe(x, logits, w13, w2, k, renorm, 4)
    # x narrower than the weights: the CPU op reads that as its padded weight layout
    # (cpu_moe.pack_moe_weights), so only the device implementations are asked here.
    for ops in (cuda_ops, npu_env[1]):
        with pytest.raises(ValueError, match="do not fit"):
            ops.fused_moe(x[:, :-1], logits, w13, w2, k, renorm, offset)
