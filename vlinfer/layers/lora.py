"""LoRA on a linear layer: up to max_loras adapters live in slots beside the base weight, and a step
adds each token's adapter update after the base matmul, grouped by adapter (the punica / S-LoRA
shrink-then-expand), so the base layer runs once for the whole batch whatever the adapters.

A slot holds one adapter's A and B for this layer on this rank: A [n_sub * max_rank, input] and B
[output, n_sub * max_rank], where n_sub is the number of projections fused in the layer (3 for qkv,
2 for gate_up): sub-projection i's A rows sit at [i * max_rank, i * max_rank + r) and its B columns
at the same place, its rows where the layer keeps that projection's output, so one shrink and one
expand serve the fused layer. B carries the adapter's scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA). Tensor parallelism as vLLM splits it: a column-parallel layer keeps A whole and B's rows of
its shard; a row-parallel layer keeps A's columns of its input shard and B whole, its update added
before the all-reduce that sums the partial outputs."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.ops.reference.lora import group_by_slot


@dataclass(frozen=True, eq=False)
class LoRAGroups:
    """One step's tokens that run a LoRA adapter, grouped by slot: what add_lora reads, built once
    per step (lora_groups) and shared by every LoRA layer. Slot s's tokens are
    rows[offsets[s]:offsets[s + 1]].

    rows: int64 [N] token indices on the device, by slot ascending and in token order within a slot;
    None when one adapter covers every token of the step (N = T, the rows are 0..T-1: nothing to
    gather). offsets: int64 [S + 1] on the device, cumulative row counts of slots 0..S-1, S = the
    highest slot used + 1 (a slot with no row has an empty range): the segment bounds a grouped GEMM
    or a kernel reads without a host sync. segments: (slot, start, count) on the host for each slot
    with rows, slot ascending; None in a captured graph's step (captured_lora_groups), whose
    grouping only the device holds. token_slots: int64 [T] on the device, each token's slot (-1: the
    base model), for kernels that mask instead of gathering.
    max_rows: the most rows of one slot, or a bound on it (host): a kernel's grid."""
    rows: torch.Tensor | None
    offsets: torch.Tensor
    segments: tuple[tuple[int, int, int], ...] | None
    token_slots: torch.Tensor
    max_rows: int

    def host_segments(self) -> tuple[tuple[int, int, int], ...]:
        """segments, for implementations that group on the host; a captured step has none to
        give."""
        if self.segments is None:
            raise ValueError(
                "LoRA groups of a captured graph step have no host segments: only a device-side "
                "add_lora "
                "(CUDA, NPU) runs them")
        return self.segments

    def merged(self, factor: int) -> "LoRAGroups":
        """The same groups over rows merged `factor` to one, when each slot's rows are whole aligned
        runs of `factor` (a run's first row names its merged row): the vision tower's patch mergers.
        No host sync."""
        rows = None if self.rows is None else self.rows[::factor] // factor
        return LoRAGroups(
            rows, self.offsets // factor,
            tuple((slot, start // factor, count // factor) for slot, start, count in self.segments),
            self.token_slots[::factor], self.max_rows // factor)


def lora_groups(slots: torch.Tensor, device) -> LoRAGroups | None:
    """The step's LoRAGroups from each token's slot (a host tensor, -1: the base model); None when
    no token runs an adapter."""
    fields = group_by_slot(slots, device)
    return None if fields is None else LoRAGroups(**fields)
def captured_lora_groups(slots: torch.Tensor, num_slots: int) -> dict[str, torch.Tensor]:
    """A captured graph step's grouping (host tensors the graph runner copies into its static
    buffers): every row in a slot, the base model's and padding rows (-1) in slot num_slots - 1,
    which the engine keeps zero (its update adds 0), so the shapes are the bucket's whatever the
    adapters. rows [T], offsets [num_slots + 1], token_slots [T]."""
    slots = slots.masked_fill(slots < 0, num_slots - 1)
    offsets = F.pad(torch.bincount(slots, minlength=num_slots).cumsum(0), (1, 0))
    return dict(rows=torch.argsort(slots, stable=True), offsets=offsets, token_slots=slots)


@dataclass
class LoRAStep:
    """One step's adapters: the tokens that run one, grouped by slot (LoRAGroups: no gather when one
    adapter covers the whole step). Built once per step by the model runner, read by every LoRA
    layer."""
    groups: LoRAGroups

    def merged(self, factor: int) -> "LoRAStep":
        """The same adapters over rows merged `factor` to one (the vision tower's patch mergers: 2x2
        patches -> 1 row). Each group's rows are whole aligned runs of `factor` (a run never spans
        two images), so a run's first row names its merged row."""
        return LoRAStep(self.groups.merged(factor))


class LoRASlots(nn.Module):
    def __init__(self, layer, max_loras: int, max_rank: int, sub_outputs: list[tuple[int, int]]):
        """sub_outputs: (first row, rows) of each sub-projection's part of this rank's output, in
        sub order."""
        super().__init__()
        num_sub = len(sub_outputs)
        self.max_rank, self.num_sub = max_rank, num_sub
        self.ops = layer.ops  # the engine's op table: add_lora runs on it
        dtype, device = layer.params_dtype, next(layer.parameters()).device
        self.a = torch.zeros(max_loras, num_sub * max_rank, layer.input_size, dtype=dtype,
                             device=device)
        # B [max_loras, out, R] as a view of [max_loras, R, out] storage: each slot's expand weight
        # is then contiguous as a [R, out] matrix, and all slots' as one [S * R, out] (the CPU op's
        # dense expand).
        self.b = torch.zeros(max_loras, num_sub * max_rank, layer.output_size, dtype=dtype,
                             device=device).transpose(1, 2)
        # the op table's own copy, or None
        self.packed = self.ops.pack_lora(self.a, self.b, sub_outputs)

    def repack(self, slot: int) -> None:
        """Refresh the op table's copy of `slot` after an adapter was installed there (clear +
        set_sub)."""
        if self.packed is not None:
            self.ops.repack_lora(self.packed, slot, self.a, self.b)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_sub(self, layer, slot: int, sub_index: int, shard_id, a: torch.Tensor, b: torch.Tensor,
                scaling: float) -> None:
        """Install one PEFT module's lora_A [r, in] and lora_B [out, r] (full checkpoint shapes) as
        sub-projection sub_index (shard_id: the fused layer's shard name, None for a plain layer) of
        `slot`, this rank's part."""
        r = a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"rank {r} is above max_lora_rank={self.max_rank}")
        _, offset, rows, _, full_rows = layer.output_shard(shard_id)
        col_start, cols, full_cols = layer.input_shard()
        if tuple(a.shape) != (r, full_cols) or tuple(b.shape) != (full_rows, r):
            raise ValueError(
                f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a {full_rows} x "
                f"{full_cols} layer (an adapter of another model?)")
        lo = sub_index * self.max_rank
        self.a[slot, lo:lo + r] = a[:, col_start:col_start + cols].to(self.a.dtype)
        b = torch.cat([b[first:first + n] for first, n in layer.checkpoint_rows(shard_id)])
        self.b[slot, offset:offset + rows, lo:lo + r] = (b.float() * scaling).to(self.b.dtype)

    def add_to(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """y + each row's adapter update: x [T, in], y [T, out] (ops add_lora, in place)."""
        return self.ops.add_lora(x, y, self.a, self.b, step.groups, self.packed)
