"""Owns the model and its KV pool; turns a scheduled batch into tensors, runs the forward and samples."""
import logging
import math

import torch

from vlinfer import platform
from vlinfer.config import EngineConfig
from vlinfer.engine.encoder_cache import EncoderCache
from vlinfer.engine.scheduler import SchedulerOutput
from vlinfer.engine.sequence import Sequence
from vlinfer.layers import Attention, ForwardContext, forward_context, sample

logger = logging.getLogger("vlinfer")

CPU_DEFAULT_MEMORY_UTILIZATION = 0.4  # of the RAM still free after the weights are loaded
ACCELERATOR_DEFAULT_MEMORY_UTILIZATION = 0.9  # of the device's total memory


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: set[int]):
        self.config = config
        self.hf_config = hf_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.kvcache_block_size
        self.eos_token_ids = eos_token_ids
        self.uses_mrope = getattr(model, "uses_mrope", False)
        self.encoder_cache = EncoderCache()
        self.num_images_encoded = 0  # over the runner's life: tests check each image is encoded once
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        if device.type != "cpu" or config.enforce_eager:
            logger.info("graph mode: not implemented for %s yet, running eager", device.type)
        else:
            logger.info("graph mode: none on cpu, running eager")

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attention_layers) * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for_budget(self, max_model_len: int) -> int:
        cfg = self.config
        per_seq = math.ceil(max_model_len / self.block_size)
        useful = cfg.max_num_seqs * per_seq  # more blocks than every sequence at full length is waste
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif self.device.type == "cpu":
            budget = (cfg.memory_utilization or CPU_DEFAULT_MEMORY_UTILIZATION) * platform.available_memory(self.device)
        else:
            peak = self.profile_peak_memory(max_model_len)
            fraction = cfg.memory_utilization or ACCELERATOR_DEFAULT_MEMORY_UTILIZATION
            budget = fraction * platform.total_memory(self.device) - peak
        num_blocks = min(int(budget // self.bytes_per_block), useful)
        if num_blocks < per_seq:
            raise ValueError(f"KV cache budget of {int(budget)} bytes holds {num_blocks} blocks of "
                             f"{self.block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
                             f"needs ({per_seq}); raise kv_cache_bytes / memory_utilization or lower max_model_len")
        return num_blocks

    @torch.inference_mode()
    def profile_peak_memory(self, max_model_len: int) -> int:
        """Peak device memory of one full-budget prefill, with a throwaway cache just big enough for it."""
        num_tokens = min(self.config.max_num_batched_tokens or max_model_len, max_model_len)
        seq = Sequence([0] * num_tokens, None)
        seq.block_table = list(range(math.ceil(num_tokens / self.block_size)))
        self.allocate_kv_cache(len(seq.block_table))
        self.execute(SchedulerOutput([seq], [num_tokens]), sample_tokens=False)
        peak = platform.peak_memory(self.device)
        self.kv_cache = None
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Zeroed, not empty: masked-out slots still enter the attention matmul, and 0 * NaN garbage is NaN.
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _positions(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        if not self.uses_mrope:
            return torch.arange(start, end)
        if seq.mrope_positions is None:  # a text-only prompt: all three rows are the token index
            return torch.arange(start, end).expand(3, -1)
        prompt_end = min(end, seq.num_prompt_tokens)
        parts = []
        if start < prompt_end:
            parts.append(seq.mrope_positions[:, start:prompt_end])
        if end > prompt_end:  # generated tokens continue on all three rows from the request's delta
            parts.append(torch.arange(max(start, prompt_end), end).expand(3, -1) + seq.mrope_position_delta)
        return torch.cat(parts, 1)

    def prepare(self, batch: SchedulerOutput):
        bs = self.block_size
        input_ids, positions, slots, cu_seqlens_q, seq_lens = [], [], [], [0], []
        sample_indices, sample_seqs = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.append(self._positions(seq, start, end))
            table = torch.tensor(seq.block_table)
            pos = torch.arange(start, end)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the chunk reaches the sequence's end: its last logits pick a token
                sample_indices.append(cu_seqlens_q[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = torch.full((len(batch.seqs), max_blocks), -1, dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        dev = self.device
        ctx = ForwardContext(
            slot_mapping=torch.cat(slots).to(dev),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            decode_only=all(n == 1 for n in batch.num_new_tokens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.cat(positions, -1).to(dev)
        mm_inputs = self._multimodal_inputs(batch, len(input_ids))
        return ids, pos, ctx, torch.tensor(sample_indices, dtype=torch.long, device=dev), sample_seqs, mm_inputs

    def _encode_missing(self, batch: SchedulerOutput) -> None:
        """Run the vision tower once, in one packed batch, over every image this step needs and the cache lacks."""
        missing = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for item in seq.mm_items:
                if item.offset < end and item.end > start and item.content_hash not in self.encoder_cache:
                    missing.setdefault(item.content_hash, item)
        if not missing:
            return
        items = list(missing.values())
        pixel_values = torch.cat([item.data["pixel_values"] for item in items]).to(self.device, self.dtype)
        grid_thw = torch.stack([item.data["grid_thw"] for item in items])
        for item, output in zip(items, self.model.encode_images(pixel_values, grid_thw)):
            assert output[0].shape[0] == item.length, "encoder output does not match the placeholder count"
            self.encoder_cache.put(item.content_hash, output)
        self.num_images_encoded += len(items)

    def _multimodal_inputs(self, batch: SchedulerOutput, num_tokens: int) -> dict:
        """mm_mask [T], mm_embeds and deepstack_embeds rows for the image tokens of this step, in token order:
        a chunk that starts or ends inside an image takes just its slice of that image's rows."""
        if not any(seq.mm_items for seq in batch.seqs):
            return {}
        self._encode_missing(batch)
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
                image_embeds, image_deepstack = self.encoder_cache.get(item.content_hash)
                embeds.append(image_embeds[lo - item.offset:hi - item.offset])
                deepstack.append(image_deepstack[:, lo - item.offset:hi - item.offset])
            base += n
        if not embeds:
            return {}
        return {"mm_mask": mask.to(self.device), "mm_embeds": torch.cat(embeds),
                "deepstack_embeds": torch.cat(deepstack, 1)}

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, sample_tokens: bool = True):
        """Run one step. Returns [(seq, token_id, logprobs or None)] for sequences that finished their chunk."""
        input_ids, positions, ctx, sample_indices, sample_seqs, mm_inputs = self.prepare(batch)
        with forward_context(ctx):
            hidden_states = self.model(input_ids, positions, **mm_inputs)
        if not sample_tokens or not sample_seqs:
            return []
        logits = self.model.compute_logits(hidden_states[sample_indices])
        tokens, logprobs = sample(logits, sample_seqs, self.eos_token_ids)
        return list(zip(sample_seqs, tokens, logprobs))

    @torch.inference_mode()
    def prompt_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled position (for tests and scoring); writes KV like a normal step."""
        input_ids, positions, ctx, _, _, mm_inputs = self.prepare(batch)
        with forward_context(ctx):
            hidden_states = self.model(input_ids, positions, **mm_inputs)
        return self.model.compute_logits(hidden_states)
