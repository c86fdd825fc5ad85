"""The LoRA op on CPU (reference.add_lora's contract), with no gather and no per-adapter loop:

- One adapter over every row (most prefills, a single-adapter batch): two plain matmuls on x.
- Otherwise: one dense shrink of every row against every used slot's A ([T, S * R]), the columns of the slots a
  row does not run zeroed (LoRAGroups.token_slots), and one dense expand against the slots' B laid out
  [S * R, out] (layers/lora.py stores B that way, so this is a view), added into y. It computes S times the
  adapter work a gather would, but in two GEMMs: at decode sizes the gather, the grouped GEMMs
  (torch._grouped_mm) and the scatter-add cost more than the work (docs/benchmarks.md "Per-op kernels": LoRA
  updates)."""
import torch

from vlinfer.ops import reference
from vlinfer.ops.per_step import PerStep


def add_lora(x, y, lora_a, lora_b, groups: reference.LoRAGroups, masks: dict) -> torch.Tensor:
    """reference.add_lora as two dense GEMMs over the used slots. masks: the op table's per-step cache of the
    shrink masks, one PerStep per (slots, rank) (every layer of a width shares its step's mask)."""
    if groups.rows is None:
        slot = groups.segments[0][0]
        return y.add_((x @ lora_a[slot].T) @ lora_b[slot].T)
    slots, rank = groups.offsets.numel() - 1, lora_a.shape[1]
    shrink = x @ lora_a[:slots].reshape(slots * rank, -1).T
    mask = masks.setdefault((slots, rank), PerStep()).get(lambda token_slots: shrink_mask(token_slots, slots, rank),
                                                           groups.token_slots)
    shrink.mul_(mask)
    return y.addmm_(shrink, lora_b[:slots].transpose(1, 2).reshape(slots * rank, -1))


def shrink_mask(token_slots: torch.Tensor, slots: int, rank: int) -> torch.Tensor:
    """[T, slots * rank] bool: row t keeps the shrink columns of its own slot."""
    owner = torch.arange(slots * rank, device=token_slots.device) // rank  # the slot of each shrink column
    return owner[None, :] == token_slots[:, None]
