"""The LoRA op's device implementations against its definition (vlinfer/ops/reference/ add_lora):
the CPU one (CpuOps, ops/cpu/lora.py: the panel kernel for small steps at every level that has it,
two dense GEMMs otherwise), the CUDA one (CudaOps: our Triton shrink / expand under the Triton
interpreter, on CPU tensors) and the NPU one (NpuOps on the emulated torch_npu's npu_grouped_matmul,
tests/fakes/fake_torch_npu.py), over fused layers (3 sub-projections) and plain ones, adapter ranks
4 / 8 / 16 in slots of max rank 16, rows spread over slots with unused slots between, rows of no
adapter, one adapter over every row; the step grouping (lora_groups) itself; and an engine with
adapters on each accelerator path against the reference op table.

Tolerances: max |update ours - update reference| / max |update reference|, the update being what the
op adds to y, the reference in float32 on the same (rounded) inputs: float32 1e-5, bfloat16 /
float16 2e-2. Rows of no adapter keep y exactly."""
import contextlib
import logging
import sys

import pytest
import torch

from cpu_levels import kernel_levels
from fake_torch_npu import FakeNpuError, install
from vlinfer.layers.lora import lora_groups
from vlinfer.ops import reference
from vlinfer.ops.select import select
from vlinfer.ops.cpu import lora as cpu_lora
from vlinfer.platform import cpu_features
from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.cuda import CudaOps
from vlinfer.ops.npu import NpuOps
from vlinfer.ops.cuda.loader import load_triton_module

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
MAX_RANK = 16
# (name, tokens' slots (-1: no adapter), max_loras, n_sub, input, output): the slots' adapters have
# ranks 4, 8, 16, 4, ... by slot; sequences bring runs of tokens, decodes one token each.
CASES = [
    # slot 1 unused between used ones
    ("decode-spread", [2, 0, -1, 2, 3, 0, -1, 3, 2], 4, 3, 64, 96),
    ("prefill-runs", [1] * 30 + [-1] * 7 + [3] * 21 + [0] * 12, 4, 3, 96, 48),
    ("one-adapter-every-row", [2] * 11, 3, 1, 64, 80),  # nothing to gather
    ("slot0-every-row", [0] * 5, 2, 2, 48, 64),  # a single group
    ("one-adapter-some-rows", [-1, 1, 1, -1, 1], 2, 3, 64, 96),
    ("plain-layer", [0, 1, 0, 1, 1, -1, 0], 2, 1, 80, 64),
]


def case_id(case):
    return case[0]


def make_case(case, dtype, seed=0):
    """(x, y, lora_a, lora_b, slots) laid out as layers/lora.py's LoRASlots keeps them:
    sub-projection i's A rows at [i * MAX_RANK, i * MAX_RANK + r) and its B columns there, B's rows
    those of its part of the output; unused columns and rows zero."""
    name, slots, max_loras, n_sub, hidden, out = case
    g = torch.Generator().manual_seed(seed + len(slots) * 7 + hidden)
    lora_a = torch.zeros(max_loras, n_sub * MAX_RANK, hidden)
    lora_b = torch.zeros(max_loras, out, n_sub * MAX_RANK)
    part = out // n_sub
    for slot in range(max_loras):
        rank = (4, 8, 16)[slot % 3]
        for i in range(n_sub):
            lo = i * MAX_RANK
            lora_a[slot, lo:lo + rank] = torch.randn(rank, hidden, generator=g) / hidden ** 0.5
            lora_b[slot, i * part:(i + 1) * part,
                   lo:lo + rank] = torch.randn(part, rank, generator=g) / rank**0.5
    x = torch.randn(len(slots), hidden, generator=g)
    y = torch.randn(len(slots), out, generator=g)
    return x.to(dtype), y.to(dtype), lora_a.to(dtype), lora_b.to(dtype), torch.tensor(slots)


def sub_outputs(case):
    """(first row, rows) of each sub-projection's output, as make_case lays them out."""
    n_sub, out = case[3], case[5]
    return [(i * (out // n_sub), out // n_sub) for i in range(n_sub)]


def packed_slots(ops, lora_a, lora_b, subs=None):
    """ops' own layout of the slots (pack_lora), every slot copied in as the engine does after an
    install; subs: the sub-projections' outputs (default: one, the whole output)."""
    packed = ops.pack_lora(lora_a, lora_b, subs or [(0, lora_b.shape[1])])
    # None: no panels at this level (AVX2)
    for slot in range(lora_a.shape[0] if packed is not None else 0):
        ops.repack_lora(packed, slot, lora_a, lora_b)
    return packed


def check(ops, case, dtype, seed=0, packed=False, forbid=contextlib.nullcontext):
    """ops.add_lora against the reference in float32: the update within TOL, the rows of no adapter
    unchanged. packed: pass the op table's packed slots too ("blocks": knowing the sub-projections'
    outputs, so a fused layer's expand reads only its own rank columns); forbid(): a context the op
    runs in."""
    x, y, lora_a, lora_b, slots = make_case(case, dtype, seed)
    groups = lora_groups(slots, "cpu")
    expected = reference.add_lora(x.float(),
                                  y.float().clone(), lora_a.float(), lora_b.float(),
                                  groups) - y.float()
    out = y.clone()
    extra = (packed_slots(ops, lora_a, lora_b,
                          sub_outputs(case) if packed == "blocks" else None), ) if packed else ()
    with forbid():
        ours = ops.add_lora(x, out, lora_a, lora_b, groups, *extra)
    assert ours is out and ours.dtype == dtype  # in place
    update = ours.float() - y.float()
    assert ((update - expected).abs().max() /
            expected.abs().max()).item() < TOL[dtype], case_id(case)
    assert torch.equal(ours[slots < 0], y[slots < 0])
    return groups


# ---- the grouping ----

def test_lora_groups_sorts_rows_by_slot():
    slots = torch.tensor([2, 0, -1, 2, 3, 0, -1, 3, 2])
    groups = lora_groups(slots, "cpu")
    assert groups.rows.tolist() == [1, 5, 0, 3, 8, 4, 7]
    assert groups.offsets.tolist() == [0, 2, 2, 5, 7] and groups.offsets.dtype == torch.int64
    assert groups.segments == ((0, 0, 2), (2, 2, 3), (3, 5, 2))
    whole = lora_groups(torch.full((6,), 2), "cpu")
    assert whole.rows is None and whole.offsets.tolist() == [0, 0, 0, 6
                                                             ] and whole.segments == ((2, 0, 6), )
    assert lora_groups(torch.full((4,), -1), "cpu") is None
    some = lora_groups(torch.tensor([-1, 1, 1]), "cpu")
    assert some.rows.tolist() == [1, 2] and some.segments == ((1, 0, 2),)


def test_merged_groups_name_the_merged_rows():
    """Runs of 4 rows per merged row (the vision tower's 2x2 patch mergers): each slot's runs merge
    to one row."""
    slots = torch.tensor([1] * 4 + [-1] * 4 + [0] * 8 + [1] * 4)
    merged = lora_groups(slots, "cpu").merged(4)
    assert merged.rows.tolist() == [2, 3, 0, 4] and merged.offsets.tolist() == [0, 2, 4]
    assert merged.segments == ((0, 0, 2), (1, 2, 2))
    whole = lora_groups(torch.full((8,), 1), "cpu").merged(4)
    assert whole.rows is None and whole.offsets.tolist() == [0, 0, 2
                                                             ] and whole.segments == ((1, 0, 2), )


def test_every_device_table_has_its_own_add_lora():
    for cls in (CpuOps, CudaOps, NpuOps):
        assert cls.add_lora is not reference.ReferenceOps.add_lora, cls.__name__


# ---- CPU: dense masked GEMMs ----

@pytest.fixture(scope="module")
def cpu_ops():
    return CpuOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cpu_add_lora_equals_reference(cpu_ops, case, dtype):
    check(cpu_ops, case, dtype)


def test_cpu_runs_two_dense_gemms_without_a_gather(cpu_ops, monkeypatch):
    """Several adapters or rows without one: no gather, no grouped GEMM, no scatter (the dense
    masked shrink and expand); one adapter over every row: two plain matmuls."""
    for case in CASES:
        x, y, lora_a, lora_b, slots = make_case(case, torch.float32)
        groups = lora_groups(slots, "cpu")
        expected = reference.add_lora(x, y.clone(), lora_a, lora_b, groups)
        with monkeypatch.context() as patch:
            patch.setattr(torch, "_grouped_mm", lambda *a, **k: pytest.fail("grouped GEMM called"))
            patch.setattr(torch.Tensor, "index_select",
                          lambda *a, **k: pytest.fail("rows gathered"))
            patch.setattr(torch.Tensor, "index_add_", lambda *a, **k: pytest.fail("rows scattered"))
            ours = cpu_ops.add_lora(x, y.clone(), lora_a, lora_b, groups)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_cpu_masks_other_slots_and_base_rows(cpu_ops):
    """Rows of no adapter keep y exactly; a row never gets another slot's update (R = 4 in bf16: any
    width)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 32, generator=g).bfloat16()
    lora_a, lora_b = torch.randn(2, 4, 64, generator=g).bfloat16() / 8, torch.randn(
        2, 32, 4, generator=g).bfloat16()
    groups = lora_groups(torch.tensor([0, 1, 1, -1, 0]), "cpu")
    ours = cpu_ops.add_lora(x, y.clone(), lora_a, lora_b, groups)
    assert torch.equal(ours[3], y[3])
    torch.testing.assert_close(ours, reference.add_lora(x, y.clone(), lora_a, lora_b, groups),
                               atol=3e-2, rtol=2e-2)


# ---- CPU: the slots in panels, small steps (cpu/csrc/lora_panels.cpp) ----

PANEL_CASES = [case for case in CASES if case[5] % 32 == 0]  # outputs in whole 32-output panels


@pytest.fixture(scope="module", params=kernel_levels())
def cpu_level(request):
    """CpuOps at this CPU's best level, and (slow tier) the generic and AVX2 ones, which have no
    panels."""
    return CpuOps(isa=request.param)


def panel_feature(dtype) -> str:
    """The CPU feature the LoRA panels of dtype need, as a skip names it."""
    return "AVX-512" if dtype == torch.float32 else "AVX512-BF16"


def takes_panels(ops, dtype) -> bool:
    """Whether this level's build runs the panel kernels for dtype (float32: AVX-512; bf16:
    AVX512-BF16)."""
    level = cpu_features.CPU_ISAS.index(ops.isa)
    return level >= cpu_features.CPU_ISAS.index("avx512" if dtype ==
                                                torch.float32 else "avx512bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", PANEL_CASES, ids=case_id)
def test_cpu_panels_equal_reference(cpu_level, case, dtype, monkeypatch):
    """Where the build has panels: the slots pack, and a small step runs the panel kernel alone (no
    GEMM through torch), within TOL of the reference: gathered rows, rows of no adapter, unused
    slots between used ones, row blocks past 16 rows and 1-3-row tails, fused layers. Where it has
    none: pack_lora gives None, and add_lora runs the dense GEMMs on the plain slots."""
    x, y, lora_a, lora_b, _ = make_case(case, dtype)
    packed = cpu_level.pack_lora(lora_a, lora_b, sub_outputs(case))
    if not takes_panels(cpu_level, dtype):
        assert packed is None
        pytest.skip(f"needs {panel_feature(dtype)}: the {cpu_level.isa} CPU build has no LoRA "
                    "panels (pack_lora gave None)")
    assert packed.a.shape[:2] == (lora_a.shape[0], -(-lora_a.shape[1] // 16))
    n_sub, out = case[3], case[5]
    # Each 32-output panel reads its sub-projection's rank columns only (MAX_RANK each) when parts
    # are whole panels.
    part = out // n_sub
    expected_ranges = [[i * MAX_RANK, (i + 1) * MAX_RANK] for i in range(n_sub)
                       for _ in range(part // 32)] \
        if part % 32 == 0 else [[0, n_sub * MAX_RANK]] * (out // 32)
    assert packed.k_ranges.tolist() == expected_ranges
    def no_torch_gemm():
        patch = monkeypatch.context()
        with patch as p:
            p.setattr(torch.Tensor, "__matmul__",
                      lambda *a: pytest.fail("a GEMM through torch on a small step"))
            p.setattr(torch.Tensor, "addmm_",
                      lambda *a, **k: pytest.fail("a GEMM through torch on a small step"))
            yield
    for packed in ("blocks", True):
        check(cpu_level, case, dtype, packed=packed,
              forbid=contextlib.contextmanager(no_torch_gemm))


def test_cpu_panels_follow_each_install(cpu_ops):
    """A slot given another adapter (another rank, another slot's values) and repacked: the next
    step reads the new one; the other slots are untouched."""
    case = CASES[0]
    x, y, lora_a, lora_b, slots = make_case(case, torch.float32)
    packed = packed_slots(cpu_ops, lora_a, lora_b)
    if packed is None:
        assert not takes_panels(cpu_ops, torch.float32)
        pytest.skip(f"needs {panel_feature(torch.float32)}: the {cpu_ops.isa} CPU build has no "
                    "LoRA panels")
    g = torch.Generator().manual_seed(5)
    lora_a[2].zero_()
    lora_b[2].zero_()
    lora_a[2, :4] = torch.randn(4, lora_a.shape[2], generator=g)
    lora_b[2, :, :4] = torch.randn(lora_b.shape[1], 4, generator=g)
    groups = lora_groups(slots, "cpu")
    stale = cpu_ops.add_lora(x, y.clone(), lora_a, lora_b, groups, packed)
    cpu_ops.repack_lora(packed, 2, lora_a, lora_b)
    fresh = cpu_ops.add_lora(x, y.clone(), lora_a, lora_b, groups, packed)
    expected = reference.add_lora(x, y.clone(), lora_a, lora_b, groups)
    torch.testing.assert_close(fresh, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stale[slots == 2], expected[slots == 2], atol=1e-3)
    torch.testing.assert_close(stale[slots != 2], expected[slots != 2], atol=1e-5, rtol=1e-5)


def test_cpu_large_steps_take_the_dense_gemms(cpu_ops, monkeypatch):
    """Past cpu_lora.PANEL_ROWS rows per adapter of the step the dense GEMMs run (their library rate
    wins there); up to it, the panels."""
    g = torch.Generator().manual_seed(3)
    lora_a, lora_b = torch.randn(2, 16, 64, generator=g) / 8, torch.randn(2, 64, 16,
                                                                          generator=g) / 4
    packed = packed_slots(cpu_ops, lora_a, lora_b)
    if packed is None:
        assert not takes_panels(cpu_ops, torch.float32)
        pytest.skip(f"needs {panel_feature(torch.float32)}: the {cpu_ops.isa} CPU build has no "
                    "LoRA panels")
    calls = []
    kernel = cpu_ops.ext.lora_panels_add
    monkeypatch.setattr(cpu_ops.ext, "lora_panels_add",
                        lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for rows, adapters, panels in [(cpu_lora.PANEL_ROWS, 1, True),
                                   (cpu_lora.PANEL_ROWS + 1, 1, False),
                                   (cpu_lora.PANEL_ROWS + 1, 2, True),
                                   (2 * cpu_lora.PANEL_ROWS + 1, 2, False)]:
        x, y = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        groups = lora_groups(torch.arange(rows) % adapters, "cpu")
        calls.clear()
        ours = cpu_ops.add_lora(x, y.clone(), lora_a, lora_b, groups, packed)
        assert calls == ([rows] if panels else []), (rows, adapters)
        torch.testing.assert_close(ours, reference.add_lora(x, y.clone(), lora_a, lora_b, groups),
                                   atol=1e-5, rtol=1e-5)


def test_panel_kernel_refuses_bad_arguments(cpu_ops):
    g = torch.Generator().manual_seed(4)
    lora_a, lora_b = torch.randn(2, 16, 64, generator=g), torch.randn(2, 64, 16, generator=g)
    packed = packed_slots(cpu_ops, lora_a, lora_b)
    if packed is None:
        assert not takes_panels(cpu_ops, torch.float32)
        pytest.skip(f"needs {panel_feature(torch.float32)}: the {cpu_ops.isa} CPU build has no "
                    "LoRA panels")
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    groups = lora_groups(torch.tensor([0, 1, 1]), "cpu")
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.ext.lora_panels_add(x, y, packed.a, packed.b, packed.k_ranges,
                                    torch.tensor([0, 1, 7]), groups.offsets)
    with pytest.raises(RuntimeError, match="x \\[T, 64\\]"):
        cpu_ops.ext.lora_panels_add(x[:, :32], y, packed.a, packed.b, packed.k_ranges, groups.rows,
                                    groups.offsets)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.ext.lora_panels_add(x, y, packed.a, packed.b[:, :, :4].contiguous(),
                                    packed.k_ranges, groups.rows, groups.offsets)
    with pytest.raises(RuntimeError, match="k range"):
        cpu_ops.ext.lora_panels_add(x, y, packed.a, packed.b,
                                    torch.tensor([[1, 4], [0, 16]], dtype=torch.int32), groups.rows,
                                    groups.offsets)


# ---- CUDA: the Triton kernels under the interpreter ----

@pytest.fixture(scope="module")
def cuda_ops():
    """CudaOps on CPU tensors with the Triton kernels interpreted (TRITON_INTERPRET=1 when they
    load)."""
    import triton  # noqa: F401  (a test dependency: a missing one fails here)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setitem(sys.modules, "flash_attn", None)
        ops = CudaOps("cpu")
        check(ops, CASES[0], torch.float32)  # loads and checks the kernels
        assert ops.features["lora"] == "triton", "the Triton LoRA kernels failed their check"
        yield ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_add_lora_equals_reference(cuda_ops, case, dtype):
    """Under the interpreter bf16 tiles are widened to float32 (it cannot run bf16 tl.dot:
    tests/ops/test_moe_ops.py), fp16 ones run as on a GPU; the GPU test below runs bf16 unwidened.
    """
    check(cuda_ops, case, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton interpreter cannot run bf16 tl.dot, so on "
                    "CPU tensors bf16 tiles are widened to float32; the unwidened branch runs on a "
                    "GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_add_lora_on_16_bit_tiles_equals_reference(dtype):
    ops = CudaOps("cuda")
    for case in CASES:
        x, y, lora_a, lora_b, slots = make_case(case, dtype)
        groups = lora_groups(slots, "cpu")
        expected = reference.add_lora(x.float(), y.float().clone(), lora_a.float(),
                                      lora_b.float(), groups) - y.float()
        out = y.cuda()
        ops.add_lora(x.cuda(), out, lora_a.cuda(), lora_b.cuda(), lora_groups(slots, "cuda"))
        update = out.cpu().float() - y.float()
        assert ((update - expected).abs().max() / expected.abs().max()).item() < TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block_m", [16, 32])
def test_triton_row_blocks_and_k_splits(cuda_ops, monkeypatch, block_m, split_k):
    """Segments longer than a row block (30 and 21 rows in 16-row blocks), and the shrink's K split
    into slices accumulated atomically (96 inputs in 16-wide slices, 3 ways)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = load_triton_module("lora")
    config = dict(BLOCK_M=block_m, BLOCK_R=16, BLOCK_K=16, SPLIT_K=split_k, BLOCK_N=32)
    x, y, lora_a, lora_b, slots = make_case(CASES[1], torch.float32)
    groups = lora_groups(slots, "cpu")
    expected = reference.add_lora(x, y.clone(), lora_a, lora_b, groups)
    ours = module.add_lora(x, y.clone(), lora_a, lora_b, groups.rows, groups.offsets, 30, config)
    assert ((ours - expected).abs().max() / (expected - y).abs().max()).item() < 1e-5


def test_missing_triton_runs_the_reference_with_a_warning(monkeypatch, caplog):
    # what `import triton` sees without the package
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    ops = CudaOps("cpu")
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        groups = check(ops, CASES[0], torch.float32)
        check(ops, CASES[1], torch.float32)
    assert ops.features["lora"] == "reference" and groups is not None
    assert caplog.text.count("Triton LoRA shrink / expand unavailable (ModuleNotFoundError") == 1
    assert "LoRA updates run the pure-torch reference" in caplog.text


# ---- NPU: npu_grouped_matmul on the emulated torch_npu ----

@pytest.fixture
def npu_env(monkeypatch):
    """(the emulated torch_npu, an NpuOps on it), as an engine on CPU tensors would select it; per
    test, so that no other test (which may import transformers, whose accelerate probes for
    torch_npu) sees the fake."""
    fake = install(monkeypatch)
    ops = select("cpu")
    assert type(ops) is NpuOps
    return fake, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_npu_add_lora_equals_reference(npu_env, case, dtype):
    fake, ops = npu_env
    before = len(fake.history)
    groups = check(ops, case, dtype)
    calls = [kw for op, kw in fake.history[before:]]
    # the shrink and the expand
    assert [op for op, _ in fake.history[before:]] == ["npu_grouped_matmul"] * 2
    slots = groups.offsets.numel() - 1
    for kw in calls:
        assert kw["group_list"] == (slots,) and kw["group_type"] == 0 and kw["group_list_type"] == 0
        assert kw["split_item"] == 2
    assert fake.last["npu_grouped_matmul"]["group_list"].tolist() == groups.offsets[1:].tolist()


def test_npu_add_lora_refuses_what_the_grouped_matmul_cannot_take(npu_env):
    _, ops = npu_env
    x, y, lora_a, lora_b, _ = make_case(CASES[4], torch.bfloat16)
    slots = torch.tensor([1024, 0, -1, 1024, 0])
    many_a = torch.zeros(1025, *lora_a.shape[1:], dtype=lora_a.dtype)
    many_b = torch.zeros(1025, *lora_b.shape[1:], dtype=lora_b.dtype)
    with pytest.raises(ValueError, match="at most 1024 groups"):
        ops.add_lora(x, y, many_a, many_b, lora_groups(slots, "cpu"))
    with pytest.raises(ValueError, match="must share a dtype"):
        groups = lora_groups(torch.tensor([0] * 5), "cpu")
        ops.add_lora(x.float(), y.float(), lora_a, lora_b, groups)


def test_fake_grouped_matmul_rejects_what_its_page_rejects(npu_env):
    """The emulation's documented checks (§2.11): counts form of length 1, sizes not adding up to
    x's rows, a transposed x, a weight neither contiguous nor transposed, float32 outside the
    single-tensor form not taken."""
    fake, _ = npu_env
    x = torch.randn(5, 8)
    w = torch.randn(2, 8, 4)
    ok = dict(split_item=2, group_type=0, group_list_type=0)
    assert fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 5]),
                                   **ok)[0].shape == (5, 4)
    with pytest.raises(FakeNpuError, match="length cannot be 1"):
        fake.npu_grouped_matmul([x], [w[:1]], group_list=torch.tensor([5]), split_item=2,
                                group_type=0, group_list_type=1)
    with pytest.raises(FakeNpuError, match="must be equal"):
        fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), **ok)
    with pytest.raises(FakeNpuError, match="not transposable"):
        fake.npu_grouped_matmul([torch.randn(8, 5).t()], [w], group_list=torch.tensor([2, 5]), **ok)
    with pytest.raises(FakeNpuError, match="contiguous or transposed"):
        fake.npu_grouped_matmul([x], [torch.randn(8, 2, 4).transpose(0, 1)],
                                group_list=torch.tensor([2, 5]), **ok)
    with pytest.raises(FakeNpuError, match="non-decreasing"):
        fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([3, 2]), **ok)


# ---- an engine with adapters on each accelerator path ----

@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A tiny Qwen3 checkpoint and two PEFT adapters of ranks 8 and 4 on every linear."""
    from transformers import AutoModelForCausalLM
    from text_checkpoints import build_checkpoint, tiny_text_config
    from lora_cases import ALL_LINEARS, make_adapter
    from vlinfer import LoRARequest
    path = str(tmp_path_factory.mktemp("lora-ops-qwen3"))
    build_checkpoint(path, tiny_text_config("qwen3", True))
    loras = [
        LoRARequest(
            name, i + 1,
            make_adapter(AutoModelForCausalLM.from_pretrained(path),
                         str(tmp_path_factory.mktemp(name)), rank, 2 * rank, False, ALL_LINEARS,
                         i + 1)) for i, (name, rank) in enumerate((("eight", 8), ("four", 4)))
    ]
    return path, loras


def engine_tokens(path, loras, ops: str):
    from vlinfer import LLM, SamplingParams
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 << 20, max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=8, ops=ops)
    requests = [None, loras[0], loras[1], loras[0], None]
    prompts = [[5, 17, 42, 99], [5, 17, 42, 99], [7, 300, 12, 48, 250, 3], [11, 12, 11, 12],
               [11, 12, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False, lora_request=requests)
    return [o.outputs[0].token_ids for o in outs]


def test_an_engine_with_adapters_on_the_accelerator_paths(adapters, monkeypatch, caplog):
    """A mixed batch (the base model and two adapters, two slots) gives the reference op table's
    tokens on the NPU ops (emulated torch_npu) and on the CUDA ops (Triton interpreted), each
    running its own add_lora."""
    path, loras = adapters
    expected = engine_tokens(path, loras, "reference")
    # the adapters change the answers
    assert expected[0] != expected[1] and expected[3] != expected[4]
    calls = []
    for ops in ("npu", "cuda"):
        with monkeypatch.context() as mp:
            if ops == "npu":
                fake = install(mp)
            else:
                mp.setenv("TRITON_INTERPRET", "1")
                mp.setitem(sys.modules, "flash_attn", None)
            cls = {"npu": NpuOps, "cuda": CudaOps}[ops]
            mp.setattr(cls, "add_lora",
                       lambda self, *a, real=cls.add_lora: calls.append(ops) or real(self, *a))
            with caplog.at_level(logging.WARNING, logger="vlinfer"):
                assert engine_tokens(path, loras, ops) == expected, ops
        assert "add_lora" not in caplog.text \
            and "LoRA shrink / expand unavailable" not in caplog.text
        if ops == "npu":
            assert fake.calls["npu_grouped_matmul"] > 0
    assert set(calls) == {"npu", "cuda"}
