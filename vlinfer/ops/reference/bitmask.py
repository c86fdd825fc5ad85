"""The definition of the structured-output mask op, `ops.apply_token_bitmask`: grammar token
bitmasks applied to a batch's logits.

A bitmask row is int32 [ceil(vocab / 32)] with bit t % 32 of word t // 32 set when token t is
allowed: the layout llguidance and xgrammar write. Plain torch ops (shift, and, masked_fill), so
this runs on CPU, CUDA and NPU tensors (the engine computes the masks on the host; this moves them
to the logits' device in one copy). The CPU op table runs our kernel instead
(cpu/csrc/paged_ops.cpp): unpacking to a [rows, vocab] boolean and filling costs ~20 ms a step for
64 rows of 49K tokens, the kernel's one pass over the words a fraction of a millisecond."""
import torch

NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab], True where allowed. Tokens past 32 * W (logits wider than
    the grammar's vocabulary) are not allowed."""
    # Bit b of every word, as int32 (bit 31 is the sign bit): one AND and one compare over [R, W,
    # 32].
    bits = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32,
                        device=bitmask.device)
    allowed = ((bitmask[:, :, None] & bits) != 0).reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], 1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bitmask[i] does not allow t. All rows in one
    masked_fill."""
    if not rows:
        return
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    # every row constrained (rows are in order): in place, no gather
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, NEG_INF)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill_(~allowed, NEG_INF)
