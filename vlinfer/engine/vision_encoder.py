"""Rank 0's vision pass: the images a step's tokens reach and the encoder cache lacks, encoded once
in one packed batch; then the step's rows of image embeddings and DeepStack features."""
from contextlib import nullcontext

import torch

from vlinfer.engine.encoder_cache import EncoderCache
from vlinfer.engine.lora_manager import step_groups
from vlinfer.layers import ForwardContext, ModelContext
from vlinfer.models.interfaces import SupportsMultiModal


class VisionEncoder:
    def __init__(self, model: SupportsMultiModal, ctx: ModelContext, device: torch.device,
                 cache: EncoderCache):
        self.model, self.ctx, self.device, self.cache = model, ctx, device, cache
        self.num_images_encoded = 0  # over the engine's life: tests check each is encoded once

    def step_rows(self, batch, num_tokens: int, lora_slot_of: dict[int, int]) -> dict:
        """mm_mask [T], mm_embeds and deepstack_embeds rows for the step's image tokens
        (EncoderCache.step_rows), encoding the images not yet cached first; {} without images."""
        if not any(seq.mm_items for seq in batch.seqs):
            return {}
        self._encode_missing(batch, lora_slot_of)
        return self.cache.step_rows(batch, num_tokens)

    def _encode_missing(self, batch, lora_slot_of: dict[int, int]) -> None:
        """Run the vision tower once, in one packed batch, over every image this step needs and the
        cache lacks; each image's patch rows under its request's vision adapter, if any."""
        missing = self.cache.missing(batch)
        if not missing:
            return
        items = [item for item, _ in missing.values()]
        pixel_values = torch.cat([item.data["pixel_values"] for item in items])
        pixel_values = pixel_values.to(self.device, self.ctx.dtype)
        grid_thw = torch.stack([item.data["grid_thw"] for item in items])
        patch_slots = torch.cat([
            torch.full((item.data["pixel_values"].shape[0],),
                       -1 if lora is None else lora_slot_of[lora.lora_int_id], dtype=torch.long)
            for item, lora in missing.values()])
        groups = step_groups(patch_slots, self.device)
        stepping = (self.ctx.stepping(ForwardContext.encoder_pass(groups)) if groups is not None
                    else nullcontext())
        with stepping:
            outputs = self.model.encode_images(pixel_values, grid_thw)
        for key, item, output in zip(missing, items, outputs):
            if output[0].shape[0] != item.length:
                raise RuntimeError(
                    f"the vision tower returned {output[0].shape[0]} embeddings for an image with "
                    f"{item.length} placeholder tokens (the checkpoint's merge size disagrees "
                    "with its preprocessor?)")
            self.cache.put(key, output)
        self.num_images_encoded += len(items)
