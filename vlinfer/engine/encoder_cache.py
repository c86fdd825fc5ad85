"""Vision encoder outputs, keyed by Sequence.encoder_key (the image's content hash and the vision
adapter it was encoded under), held while any unfinished request holds that key; and a step's rows
of them.

Held for the request's whole life rather than dropped once its image chunks ran: a preempted request
recomputes its prompt and needs them again, and identical images in concurrent requests (under the
same vision adapter, or none) are encoded once."""
import torch


class EncoderCache:
    def __init__(self):
        # key -> (embeds, deepstack)
        self.outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.holders: dict[tuple, set[int]] = {}  # key -> ids of the sequences that hold it

    def __len__(self) -> int:
        return len(self.outputs)

    def hold(self, seq) -> None:
        for item in seq.mm_items:
            self.holders.setdefault(seq.encoder_key(item), set()).add(seq.seq_id)

    def release(self, seq) -> None:
        for item in seq.mm_items:
            key = seq.encoder_key(item)
            holders = self.holders.get(key)
            if holders is None:
                continue
            holders.discard(seq.seq_id)
            if not holders:
                del self.holders[key]
                self.outputs.pop(key, None)

    def __contains__(self, key: tuple) -> bool:
        return key in self.outputs

    def get(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return self.outputs[key]

    def put(self, key: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.outputs[key] = output

    def missing(self, batch) -> dict:
        """{key: (item, vision adapter or None)} for every item a step's tokens reach and the cache
        lacks, once."""
        missing = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for item in seq.mm_items:
                key = seq.encoder_key(item)
                if item.offset < end and item.end > start and key not in self.outputs:
                    missing.setdefault(key, (item, seq.vision_lora))
        return missing

    def step_rows(self, batch, num_tokens: int) -> dict:
        """mm_mask [T], mm_embeds and deepstack_embeds rows for the image tokens of a step whose
        items are all cached, in token order: a chunk that starts or ends inside an image takes just
        its slice of that image's rows. {} when the step has no image token."""
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        embeds, deepstack = [], []
        base = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for item in seq.mm_items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                mask[base + lo - start:base + hi - start] = True
                image_embeds, image_deepstack = self.outputs[seq.encoder_key(item)]
                embeds.append(image_embeds[lo - item.offset:hi - item.offset])
                deepstack.append(image_deepstack[:, lo - item.offset:hi - item.offset])
            base += n
        if not embeds:
            return {}
        return {
            "mm_mask": mask, "mm_embeds": torch.cat(embeds),
            "deepstack_embeds": torch.cat(deepstack, 1)
        }
