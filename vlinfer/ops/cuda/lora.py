"""The LoRA op for CUDA: our Triton shrink and expand kernels (triton/lora.py) behind
reference.add_lora's contract, on the step's LoRA groups as they come (layers/lora.py LoRAGroups)
(rows sorted by slot, device offsets; the grid from the host bound on the longest segment, so no
host sync: a captured CUDA graph step runs it too).

CudaOps loads and checks the kernels the first time a LoRA layer runs (loader.TritonKernels), not at
engine start: an engine without adapters pays nothing. A Triton that is missing or fails the check
is a warning, and the op runs the reference (one shrink-expand per adapter in torch)."""
import types

import torch

from vlinfer.ops import reference
from vlinfer.ops.reference.lora import group_by_slot
from vlinfer.ops.cuda.loader import load_triton_module


def checked_kernel(device: torch.device):
    """The kernels' add_lora, after one tiny step against the reference: a fused layer (3
    sub-projections of rank
    4) with rows spread over two of three slots, a row of no adapter, the K split on and off; and
       one adapter over every row. Surfaces a Triton that cannot compile or computes wrong here
       (CudaOps loads it on first use)."""
    module = load_triton_module("lora")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g).to(device)
    lora_a = (torch.randn(3, 12, 96, generator=g) / 10).to(device)
    lora_b = (torch.randn(3, 40, 12, generator=g) / 4).to(device)
    for slots, split_k in (([2, 0, -1, 2, 2, 0], 1), ([2, 0, -1, 2, 2, 0], 2), ([1] * 6, 1)):
        groups = _Groups(**group_by_slot(torch.tensor(slots), device))
        y = torch.randn(6, 40, generator=g).to(device)
        expected = reference.add_lora(x, y.clone(), lora_a, lora_b, groups)
        config = module.block_config(4, 96, 12) | {"SPLIT_K": split_k}
        ours = add_lora(module.add_lora, x, y, lora_a, lora_b, groups, config)
        err = ((ours - expected).abs().max() / expected.abs().max()).item()
        if not err < 1e-4:
            raise RuntimeError(
                f"the Triton LoRA shrink / expand is off from the reference by {err:.3g}")
    return module.add_lora


def add_lora(kernel, x, y, lora_a, lora_b, groups, config: dict | None = None):
    """reference.add_lora on the Triton kernels."""
    return kernel(x, y, lora_a, lora_b, groups.rows, groups.offsets, groups.max_rows, config)


class _Groups(types.SimpleNamespace):
    """A step's grouping as add_lora reads it (layers/lora.py LoRAGroups, duck-typed: ops never
    import layers)."""

    def host_segments(self):
        return self.segments
