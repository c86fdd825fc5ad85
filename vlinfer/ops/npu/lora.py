"""The LoRA op on torch_npu (NpuOps.add_lora), reference.add_lora's contract, as two
npu_grouped_matmul calls (docs/npu-ops.md §2.11, §7.8): the step's adapter rows gathered once
(already grouped by slot: layers/lora.py LoRAGroups), the shrink against every slot's A and the
expand against every slot's B with the segments as the group list, then one add into the base
output.

- The form: one x, one 3-D weight, one y (group_type 0, split M; split_item 2), the weights passed
  as transposed
  views of the slots ([S, in, R] of A [S, R, in], [S, R, out] of B: the documented "weight
  transposed", no copy),
  S = the highest slot used + 1, a slot without rows an empty group.
- group_list: the device offsets' cumulative ends (group_list_type 0). The counts form (type 1) is
  documented as
  "length cannot be 1", which a step with one adapter in slot 0 would be; the cumsum form has no
  such limit.
- Not vllm-ascend's punica ops (bgmv / sgmv shrink and expand, `torch.ops._C_ascend`): those are
  vllm-ascend's own
  AscendC kernels, built with it and not in torch_npu, and vllm-ascend itself takes them only on
  hardware flagged
  for them with max_lora_rank < 128; the grouped matmul is in the torch_npu wheel and documented.

Nothing here reads a value back to the host. Nothing here has run on an NPU;
tests/fakes/fake_torch_npu.py emulates the grouped matmul from its documented contract."""
import torch

# npu_grouped_matmul, group_type 0 with one weight tensor: groups of one call (§2.11)
MAX_GROUPS = 1024


def add_lora(torch_npu, x, y, lora_a, lora_b, groups) -> torch.Tensor:
    num_slots = groups.offsets.numel() - 1
    if num_slots > MAX_GROUPS:
        raise ValueError(
            f"add_lora on NPU: slot {num_slots - 1} in use; npu_grouped_matmul takes at most "
            f"{MAX_GROUPS} groups")
    if not x.dtype == lora_a.dtype == lora_b.dtype:
        raise ValueError(
            f"add_lora on NPU: x {x.dtype} and the LoRA slots {lora_a.dtype} / {lora_b.dtype} must "
            "share a dtype (npu_grouped_matmul)")
    rows = groups.rows
    # x is not transposable (§2.11)
    rows_x = x.contiguous() if rows is None else x.index_select(0, rows)
    gmm = dict(group_list=groups.offsets[1:], split_item=2, group_type=0, group_list_type=0)
    shrink = torch_npu.npu_grouped_matmul([rows_x], [lora_a[:num_slots].transpose(1, 2)], **gmm)[0]
    update = torch_npu.npu_grouped_matmul([shrink], [lora_b[:num_slots].transpose(1, 2)], **gmm)[0]
    return y.add_(update) if rows is None else y.index_add_(0, rows, update)
