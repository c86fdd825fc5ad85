"""What a LoRA update means: each token's adapter shrink and expand added to the base layer's
output, on the step's tokens grouped by adapter slot (layers/lora.py LoRAGroups, taken duck-typed:
ops never import layers)."""
import torch
import torch.nn.functional as F


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             groups, packed=None) -> torch.Tensor:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for each token t of slot s in groups, in place;
    returns y.

    x [T, in], y [T, out] (the base layer's output); lora_a [max_loras, R, in], lora_b [max_loras,
    out, R], the slots' shrink and expand (layers/lora.py: R = n_sub * max_rank, the scaling folded
    into lora_b). The shrink is rounded to x's dtype before the expand. Tokens of no slot keep y.
    packed: an implementation's own copy of the same slots (its pack_lora; None here)."""
    for slot, start, count in groups.host_segments():
        a, b = lora_a[slot], lora_b[slot]
        if groups.rows is None:
            y.add_((x @ a.T) @ b.T)
        else:
            rows = groups.rows[start:start + count]
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
    return y


def group_by_slot(slots: torch.Tensor, device) -> dict | None:
    """How a step's tokens group by adapter slot, from each token's slot (a host tensor, -1: the
    base model): the fields of a LoRAGroups (layers/lora.py builds it from these); None when no
    token runs an adapter."""
    used = (slots >= 0).nonzero().flatten()
    if not used.numel():
        return None
    counts = torch.bincount(slots[used])
    offsets = F.pad(counts.cumsum(0), (1, 0))
    segments = tuple(
        (s, int(offsets[s]), int(counts[s])) for s in counts.nonzero().flatten().tolist())
    whole = len(segments) == 1 and used.numel() == slots.numel()
    rows = None if whole else used[torch.argsort(slots[used], stable=True)].to(device)
    return dict(rows=rows, offsets=offsets.to(device), segments=segments,
                token_slots=slots.to(device), max_rows=int(counts.max()))
