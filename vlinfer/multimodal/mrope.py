"""Qwen3-VL multimodal rotary positions (MRoPE): a prompt's 3-row (t, h, w) position ids. The
cos/sin they select are model maths, beside the rotary layer (layers/rotary.py mrope_cos_sin).

Text tokens advance all three rows together. An image's placeholder tokens (one per merged patch,
row-major over the merged grid) get t/h/w coordinates offset by the current position, and the text
after it resumes at current + max(h, w) / merge, so positions run ahead of / behind token indices by
a per-sequence constant `delta` after the last image: decode token i sits at i + delta on all rows.
"""
import torch


def mrope_positions(input_ids, image_grid_thw, image_token_id: int, vision_start_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """positions [3, L] (long, CPU) and delta = max_position + 1 - L, equal to HF `get_rope_index`
    for one sequence.

    Images are the runs of `image_token_id`, matched in order to `image_grid_thw`; each image owns
    exactly t*h*w / merge^2 consecutive placeholders, so back-to-back images without separators are
    still split right. `vision_start_token_id` is accepted for signature parity with the
    processor-side contract (images are `<vision_start> <image>* <vision_end>`), but the placeholder
    runs alone determine the positions.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    grids = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else \
        [list(g) for g in (image_grid_thw or [])]
    L = len(ids)
    m = spatial_merge_size
    chunks = []
    pos = 0  # next position to hand out
    i = 0  # next token index
    image = 0
    while i < L:
        if ids[i] != image_token_id:
            j = i
            while j < L and ids[j] != image_token_id:
                j += 1
            chunks.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        if image >= len(grids):
            raise ValueError("more image placeholder runs than entries in image_grid_thw")
        t, h, w = (int(v) for v in grids[image])
        gh, gw = h // m, w // m
        n = t * gh * gw
        if ids[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image {image}: expected {n} placeholder tokens at index {i}")
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        chunks.append(torch.stack([tt, hh, ww]).reshape(3, n) + pos)
        # HF advances by the spatial extent only (not t): the next text starts after the larger
        # side.
        pos += max(gh, gw)
        i += n
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} grids given but {image} image placeholder runs found")
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(chunks, dim=1).long()
    return positions, int(positions.max()) + 1 - L
