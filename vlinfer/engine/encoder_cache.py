"""Vision encoder outputs, keyed by image content hash, held while any unfinished request holds that image.

Held for the request's whole life rather than dropped once its image chunks ran: a preempted request recomputes
its prompt and needs them again, and identical images in concurrent requests are encoded once."""
import torch


class EncoderCache:
    def __init__(self):
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # hash -> (embeds, deepstack)
        self.holders: dict[int, set[int]] = {}  # hash -> ids of the sequences that hold it

    def __len__(self) -> int:
        return len(self.outputs)

    def hold(self, seq) -> None:
        for item in seq.mm_items:
            self.holders.setdefault(item.content_hash, set()).add(seq.seq_id)

    def release(self, seq) -> None:
        for item in seq.mm_items:
            holders = self.holders.get(item.content_hash)
            if holders is None:
                continue
            holders.discard(seq.seq_id)
            if not holders:
                del self.holders[item.content_hash]
                self.outputs.pop(item.content_hash, None)

    def __contains__(self, content_hash: int) -> bool:
        return content_hash in self.outputs

    def get(self, content_hash: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.outputs[content_hash]

    def put(self, content_hash: int, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.outputs[content_hash] = output
