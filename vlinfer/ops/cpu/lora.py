"""The LoRA op on CPU (reference.add_lora's contract), with no per-adapter loop:

- Up to PANEL_ROWS rows per adapter (decode steps, small chunks), where the build has panels for the
  dtype: the
  slots' A and B packed in panels (pack / repack_slot), each row against its own slot's panels in
  one kernel call
  (csrc/lora_panels.cpp). At these sizes a GEMM library's call costs more than the few MFLOP of
  work.
- Otherwise, one adapter over every row (most prefills): two plain matmuls on x.
- Otherwise: one dense shrink of every row against every used slot's A ([T, S * R]), the columns of
  the slots a
  row does not run zeroed (layers/lora.py LoRAGroups.token_slots), and one dense expand against the
  slots' B laid out [S * R, out] (layers/lora.py stores B that way, so this is a view), added into
  y: S times the adapter work a gather would, in two GEMMs that run at the library's rate
  (docs/benchmarks.md "Per-op kernels": LoRA updates)."""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vlinfer.ops.cpu import panels as cpu_panels
from vlinfer.ops.interface import PerStep

# Most rows per adapter in a step that takes the panel kernel: past it the dense GEMMs' library rate
# wins (the dense form's work grows with the adapters, the panels' does not; docs/benchmarks.md
# "LoRA updates").
PANEL_ROWS = 128

# Outputs per panel of the slots' A (the shrink's): ranks come in 16s, and 32-wide panels would
# double rank 16's work.
RANK_PANEL = 16


class LoRAPanels(NamedTuple):
    """A layer's LoRA slots in panels: a [max_loras, R' / 16, in, 16] (bf16: [..., in / 2, 16, 2]),
    b [max_loras, out / 32, R', 32] (bf16: [..., R' / 2, 32, 2]), R' the slot width rounded up to a
    multiple of 16 (the extra rows zero); k_ranges int32 [out / 32, 2]: the columns of B each output
    panel can have non-zero (a fused layer's sub-projection has only its own rank's: the expand
    skips the others)."""
    a: torch.Tensor
    b: torch.Tensor
    k_ranges: torch.Tensor


def pack(lora_a: torch.Tensor, lora_b: torch.Tensor, sub_outputs: list[tuple[int, int]],
         has_panels: bool) -> LoRAPanels | None:
    """Empty panels for slots shaped lora_a [max_loras, R, in] / lora_b [max_loras, out, R] (new
    slots are zero), sub_outputs the (first row, rows) of each sub-projection's output
    (layers/lora.py), or None where the build has no panels for their dtype (has_panels) or the
    shapes are not whole panels."""
    max_loras, rank, inp = lora_a.shape
    out = lora_b.shape[1]
    if not has_panels or out % cpu_panels.PANEL or inp % 2:
        return None
    width = -(-rank // RANK_PANEL) * RANK_PANEL
    k_ranges = torch.tensor([[0, width]] * (out // cpu_panels.PANEL), dtype=torch.int32)
    if all(first % cpu_panels.PANEL == 0 and rows % cpu_panels.PANEL == 0
           for first, rows in sub_outputs):
        sub_rank = rank // len(sub_outputs)
        # each panel within one sub-projection: its columns only
        for i, (first, rows) in enumerate(sub_outputs):
            begin, end = i * sub_rank // 2 * 2, -(-(i + 1) * sub_rank // 2) * 2
            k_ranges[first // cpu_panels.PANEL:(first + rows) // cpu_panels.PANEL] = torch.tensor(
                [begin, end])
    return LoRAPanels(cpu_panels.to_panels(lora_a.new_zeros(max_loras, width, inp), RANK_PANEL),
                      cpu_panels.to_panels(lora_b.new_zeros(max_loras, out, width)), k_ranges)


def repack_slot(panels: LoRAPanels, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """Copy slot `slot` of the plain slots into its panels (after an adapter was installed there).
    """
    width, rank = panels.a.shape[1] * RANK_PANEL, lora_a.shape[1]
    panels.a[slot] = cpu_panels.to_panels(F.pad(lora_a[slot], (0, 0, 0, width - rank)), RANK_PANEL)
    panels.b[slot] = cpu_panels.to_panels(F.pad(lora_b[slot], (0, width - rank)))


def add_lora(ext, x, y, lora_a, lora_b, groups, masks: dict,
             panels: LoRAPanels | None) -> torch.Tensor:
    """reference.add_lora on the panels (small steps) or as dense GEMMs. masks: the op table's
    per-step cache of the shrink masks, one PerStep per (slots, rank) (every layer of a width shares
    its step's mask)."""
    segments = groups.host_segments()
    if panels is not None and x.shape[0] <= PANEL_ROWS * len(segments) and y.is_contiguous():
        ext.lora_panels_add(x, y, panels.a, panels.b, panels.k_ranges, groups.rows, groups.offsets)
        return y
    if groups.rows is None:
        slot = segments[0][0]
        return y.add_((x @ lora_a[slot].T) @ lora_b[slot].T)
    slots, rank = groups.offsets.numel() - 1, lora_a.shape[1]
    shrink = x @ lora_a[:slots].reshape(slots * rank, -1).T
    mask = masks.setdefault(
        (slots, rank), PerStep()).get(lambda token_slots: shrink_mask(token_slots, slots, rank),
                                      groups.token_slots)
    shrink.mul_(mask)
    return y.addmm_(shrink, lora_b[:slots].transpose(1, 2).reshape(slots * rank, -1))


def shrink_mask(token_slots: torch.Tensor, slots: int, rank: int) -> torch.Tensor:
    """[T, slots * rank] bool: row t keeps the shrink columns of its own slot."""
    # the slot of each shrink column
    owner = torch.arange(slots * rank, device=token_slots.device) // rank
    return owner[None, :] == token_slots[:, None]
