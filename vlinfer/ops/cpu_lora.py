"""The LoRA op on CPU (reference.add_lora's contract): the step's adapter rows gathered once, one grouped GEMM for
the shrink and one for the expand over the slots' segments, one scatter-add into the base output.

- One adapter in the step (most prefills, a single-adapter batch): two plain matmuls, on x itself when the adapter
  covers every row (nothing gathered).
- Several: `torch._grouped_mm` over the rows sorted by slot against every slot's A, then B (slots without rows are
  empty groups), so no Python loop over adapters. Against a loop of matmuls per adapter it ties at 4 adapters and
  wins at 16 (no per-adapter call overhead); a batched matmul over each row's gathered A / B (bgmv) was 1.2-25x
  slower (it copies R x in weights per row). Figures: docs/benchmarks.md "Per-op kernels" (LoRA updates).
- torch's CPU grouped GEMM needs row strides in multiples of 16 bytes (pytorch/pytorch#161717, cpu_moe.py): where
  `in` or R (n_sub * max_lora_rank) in x's dtype is not, a step with several adapters runs the reference (one
  shrink-expand per adapter), logged once per shape."""
import logging

import torch

from vlinfer.ops import reference
from vlinfer.ops.cpu_moe import STRIDE_BYTES

logger = logging.getLogger("vlinfer")


def grouped_gemm_takes(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes this layer's shrink and expand: contiguous slots, the rows of x, A and the
    shrink ([N, R], B's transposed rows) strided in multiples of STRIDE_BYTES."""
    size = x.element_size()
    return lora_a.is_contiguous() and lora_b.is_contiguous() and lora_a.dtype == lora_b.dtype == x.dtype and \
        x.shape[1] * size % STRIDE_BYTES == 0 and lora_a.shape[1] * size % STRIDE_BYTES == 0


def add_lora(x, y, lora_a, lora_b, groups: reference.LoRAGroups, warned: set) -> torch.Tensor:
    """reference.add_lora on the grouped GEMMs; `warned`: the op table's set of shapes already logged."""
    rows = groups.rows
    if len(groups.segments) > 1 and not grouped_gemm_takes(x, lora_a, lora_b):
        key = ("add_lora", x.dtype, x.shape[1], lora_a.shape[1])
        if key not in warned:
            warned.add(key)
            logger.warning("ops[cpu]: add_lora: torch._grouped_mm needs row strides in multiples of %d bytes, not "
                           "in=%d / R=%d in %s; steps with several adapters run the reference (one shrink-expand "
                           "per adapter)", STRIDE_BYTES, x.shape[1], lora_a.shape[1], x.dtype)
        return reference.add_lora(x, y, lora_a, lora_b, groups)
    rows_x = x if rows is None else x.index_select(0, rows)
    if len(groups.segments) == 1:
        slot = groups.segments[0][0]
        update = (rows_x @ lora_a[slot].T) @ lora_b[slot].T
    else:
        slots = groups.offsets.numel() - 1
        offs = groups.offsets[1:].to(torch.int32)
        shrink = torch._grouped_mm(rows_x, lora_a[:slots].transpose(1, 2), offs=offs)
        update = torch._grouped_mm(shrink, lora_b[:slots].transpose(1, 2), offs=offs)
    return y.add_(update) if rows is None else y.index_add_(0, rows, update)
