"""Owns the model and its KV pool; turns a scheduled batch into tensors, runs the forward and samples.

Under tensor parallelism every rank has a ModelRunner over its shard of the model and its heads of the KV pool.
Rank 0's runner does everything that needs the requests (scheduling is upstream): it builds the step's inputs,
runs the vision tower for new images, sends the inputs to the workers (vlinfer/distributed/driver.py), runs its
share of the forward alongside them, and samples. A worker's runner only runs `forward` on what it receives
(vlinfer/engine/worker.py)."""
import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from vlinfer import platform
from vlinfer.config import EngineConfig
from vlinfer.engine import graph_runner
from vlinfer.engine.build_model import pack_weights
from vlinfer.engine.encoder_cache import EncoderCache
from vlinfer.engine.lora_manager import LoRAManager, install, step_groups
from vlinfer.engine.sampler import prompt_logprob_entries, sample
from vlinfer.engine.scheduler import SchedulerOutput
from vlinfer.engine.sequence import Sequence
from vlinfer.layers import Attention, ForwardContext, ModelContext
from vlinfer.layers.linear import LinearBase

logger = logging.getLogger("vlinfer")


@dataclass
class StepInputs:
    """One step's model inputs, built by rank 0 and run by every rank. CPU tensors, except image rows from the
    encoder cache (on rank 0's device; the control channel sends them as CPU bytes)."""
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], or [3, T] for multimodal rotary
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_only: bool
    mm_inputs: dict  # mm_mask, mm_embeds, deepstack_embeds for steps that carry image tokens
    logits_indices: torch.Tensor | None  # rows whose logits are computed; None: every row
    compute_logits: bool = True
    # Rows whose pooled output (hidden state, or a classifier's logits) pooling requests take: each one's last
    # prompt token, in the step where its prefill ends. None or empty: no pooling request ends this step.
    pool_indices: torch.Tensor | None = None
    # Each token's LoRA slot (-1: the base model); None when no request in the step runs an adapter.
    lora_slots: torch.Tensor | None = None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: torch.dtype) -> int:
    """One token's K and V over every layer as stored: the rows, and an int8 cache's per-row float32 scales."""
    element = torch.empty((), dtype=kv_cache_dtype).element_size()
    row = head_dim * element + (4 if kv_cache_dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * row


def kv_cache_scales(kv_cache_dtype: torch.dtype, quantized: bool, shape: tuple, device, ops) -> torch.Tensor | None:
    """The scales of a cache stored in another dtype than the compute dtype (ops/kv_quant_reference.py): int8, one
    per token and KV head, written with each row (1.0 under a checkpoint's static scales), in the memory order the op
    table's kernels read; a floating cache, one per layer for K and for V, 1.0 until a checkpoint's scales fill them.
    None for a cache of the compute dtype."""
    if not quantized:
        return None
    if kv_cache_dtype == torch.int8:
        return ops.int8_kv_scales(shape, device)
    return torch.ones(*shape[:2], dtype=torch.float32, device=device)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model: torch.nn.Module, ctx: ModelContext,
                 device: torch.device, block_size: int, eos_token_ids: set[int], driver=None, grammar_matchers=None):
        self.config = config
        self.driver = driver  # rank 0 of a tensor-parallel engine: sends each step to the workers
        # Rank 0's structured-output masks (vlinfer/structured/matchers.py); workers never sample, so never mask.
        self.grammar_matchers = grammar_matchers
        self.hf_config = hf_config
        self.ctx = ctx  # the model's op table, tensor-parallel group and step metadata: this runner's alone
        self.model = model
        pack_weights(model)  # the op table's weight layout (e.g. oneDNN-packed linears on CPU)
        self.device = device
        self.dtype = ctx.dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.uses_mrope = getattr(model, "uses_mrope", False)
        self.encoder_cache = EncoderCache()
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # with a quantized cache: kv_cache_scales
        self.num_images_encoded = 0  # over the runner's life: tests check each image is encoded once
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        # Decode steps replay captured graphs once capture_graphs() has run (after the KV pool exists); None: eager.
        self.graph_backend = graph_runner.select_backend(config, device, ctx.ops,
                                                         ctx.kv_cache_dtype if ctx.kv_cache_quantized else None)
        self.graphs: graph_runner.GraphRunner | None = None
        # Blocks past those the block manager hands out, where padded graph rows write (NPU: no -1 slots); the pool
        # budget covers them.
        self.num_dummy_blocks = graph_runner.dummy_blocks(self.graph_backend, config.max_num_seqs, self.block_size)
        self.dummy_block: int | None = None
        # LoRA slots on the model's linears (every rank: workers install their shard of each adapter; the vision
        # tower's, on rank 0 alone).
        self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                                zero_slot=self.graph_backend is not None) if config.enable_lora else None
        if ctx.kv_cache_quantized:
            self._log_kv_cache_reader()

    def _log_kv_cache_reader(self) -> None:
        stored, ops = self.kv_cache_dtype, self.ctx.ops
        static = [layer.static_kv_scales is not None for layer in self.attention_layers]
        if all(static):
            logger.info("KV cache in %s with the checkpoint's static scales (%s)", stored,
                        "fp8: k_scale / v_scale per layer" if stored != torch.int8 else
                        "int8: K's scales on the query, V's on the output")
        elif stored in (torch.float8_e4m3fn, torch.float8_e5m2):
            logger.warning("KV cache in %s: the checkpoint has no k_scale / v_scale, so both are 1.0 (as vLLM does)",
                           stored)
        if stored in ops.kv_cache_kernels:
            logger.info("KV cache in %s: %s kernels write it and read it", stored, ops.name)
        else:
            logger.warning("KV cache in %s: %s has no kernel that reads it; its writes and attention run the "
                           "pure-torch reference (ops/kv_quant_reference.py)", stored, ops.name)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.ctx.kv_cache_dtype or self.dtype

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * kv_bytes_per_token(len(self.attention_layers), self.num_kv_heads, self.head_dim,
                                                     self.kv_cache_dtype)

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int) -> int:
        """Peak device memory of one prefill step of num_tokens, with a throwaway cache just big enough for it."""
        seq = Sequence([0] * num_tokens, None)
        seq.block_table = list(range(math.ceil(num_tokens / self.block_size)))
        self.allocate_kv_cache(len(seq.block_table))
        self.execute(SchedulerOutput([seq], [num_tokens]), sample_tokens=False)
        peak = platform.peak_memory(self.device)
        self.kv_cache = self.kv_scales = None
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates the same number of blocks (the block tables come from rank 0), each of its own
        KV heads only. kv_cache_bytes and memory budgets are per rank."""
        if self.driver is not None:
            self.driver.call("allocate_kv_cache", num_blocks)
        self.graphs = None  # captured over the old pool's addresses
        # Drop an old pool (the profiling one), views included, before the new one is made.
        self.kv_cache = self.kv_scales = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
            layer.k_scale = layer.v_scale = None
        # Empty, not zeroed: untouched pages cost no RAM, so a generous pool only occupies what requests use.
        # Every attention path reads only slots below each sequence's length (the reference masks the padding
        # it gathers), so stale or uninitialized slots never reach an output.
        shape = (2, len(self.attention_layers), num_blocks + self.num_dummy_blocks, self.block_size, self.num_kv_heads)
        self.kv_cache = torch.empty(*shape, self.head_dim, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_scales = kv_cache_scales(self.kv_cache_dtype, self.ctx.kv_cache_quantized, shape, self.device,
                                         self.ctx.ops)
        self.dummy_block = num_blocks if self.num_dummy_blocks else None  # the first block past the manager's
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
                if layer.static_kv_scales is not None and self.kv_cache_dtype != torch.int8:  # fp8: the layer's pair
                    layer.k_scale.fill_(layer.static_kv_scales.k_scale)
                    layer.v_scale.fill_(layer.static_kv_scales.v_scale)

    def capture_graphs(self, resolved) -> None:
        """Capture the decode graphs over the current KV pool for up to resolved.max_num_seqs sequences of up to
        resolved.max_model_len tokens, when this engine runs graph mode."""
        if self.graph_backend is None:
            return
        sizes = graph_runner.batch_sizes(resolved.max_num_seqs)
        width = graph_runner.blocks_for(self.graph_backend, resolved.max_model_len, self.block_size, self.dtype)
        graphs = graph_runner.GraphRunner(self.model, self.ctx, self.device, self.graph_backend, sizes, width,
                                          self.uses_mrope, self.dummy_block, self.block_size,
                                          self.lora.num_slots if self.lora else 0)
        try:
            graphs.capture()
        except Exception as e:  # out of memory after the KV pool, an op that syncs, ...
            logger.warning("graph mode: capture failed (%s: %s), running eager", type(e).__name__,
                           str(e).splitlines()[0][:200] if str(e) else "")
            return
        self.graphs = graphs

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

    def prepare(self, batch: SchedulerOutput
                ) -> tuple[StepInputs, list[Sequence], list[tuple[Sequence, int]], list[Sequence]]:
        """The step's inputs; the sequences that sample a token; the (sequence, prompt position) pairs whose
        prompt logprobs this step computes; and the pooling sequences whose prefill ends this step. Logits rows:
        the prompt positions first, then the sampling rows."""
        bs = self.block_size
        input_ids, positions, slots, cu_seqlens_q, seq_lens = [], [], [], [0], []
        sample_indices, sample_seqs, prompt_indices, prompt_rows, pool_indices, pool_seqs = [], [], [], [], [], []
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = torch.full((len(batch.seqs), max_blocks), -1, dtype=torch.int32)
        slot_of = self._activate_loras(batch)  # before the vision pass, whose adapters take slots too
        for i, seq in enumerate(batch.seqs):
            block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        segments = []  # each attention segment's sequence (a row of block_tables)
        for i, (seq, n, table) in enumerate(zip(batch.seqs, batch.num_new_tokens, block_tables)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end] + seq.spec_token_ids)  # proposals follow the last token
            positions.append(self._positions(seq, start, end))
            pos = torch.arange(start, end)
            slots.append(table[pos // bs].long() * bs + pos % bs)
            if seq.prompt_logprobs is not None:  # position j's logits give prompt token j + 1 its logprob
                for j in range(start, min(end, seq.num_prompt_tokens - 1)):
                    prompt_indices.append(cu_seqlens_q[-1] + j - start)
                    prompt_rows.append((seq, j + 1))
            # A verification (the last token and its proposals) runs as one-token decode rows, each attending up to
            # itself: the kernels, graphs and rounding of decoding, so its greedy tokens are decoding's own.
            for seq_len in (range(start + 1, end + 1) if seq.spec_token_ids else (end,)):
                seq_lens.append(seq_len)
                cu_seqlens_q.append(cu_seqlens_q[-1] + (1 if seq.spec_token_ids else n))
                segments.append(i)
            if end == seq.num_tokens and seq.pooling_params is not None:  # a pooling prefill ends: pool its row
                pool_indices.append(cu_seqlens_q[-1] - 1)
                pool_seqs.append(seq)
            elif end == seq.num_tokens + len(seq.spec_token_ids):  # the chunk reaches the end: its last rows sample
                sample_indices.extend(range(cu_seqlens_q[-1] - 1 - len(seq.spec_token_ids), cu_seqlens_q[-1]))
                sample_seqs.append(seq)
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=torch.cat(positions, -1),
            slot_mapping=torch.cat(slots),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables if len(segments) == len(batch.seqs) else block_tables[segments],
            decode_only=len(input_ids) == len(seq_lens),
            mm_inputs=self._multimodal_inputs(batch, len(input_ids), slot_of),
            logits_indices=torch.tensor(prompt_indices + sample_indices, dtype=torch.long),
            pool_indices=torch.tensor(pool_indices, dtype=torch.long),
        )
        if slot_of:  # each token's LoRA slot
            inputs.lora_slots = torch.cat([torch.full((n,), slot_of[seq.lora_request.lora_int_id] if seq.lora_request
                                                      else -1, dtype=torch.long)
                                           for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        return inputs, sample_seqs, prompt_rows, pool_seqs

    def _activate_loras(self, batch: SchedulerOutput) -> dict[int, int]:
        """Install the step's adapters (rank 0 decides, every rank installs): {lora_int_id: slot}."""
        requests = {seq.lora_request.lora_int_id: (seq.lora_request, seq.lora_adapter)
                    for seq in batch.seqs if seq.lora_request}
        return self.lora.activate(requests, self.install_lora) if requests else {}

    def install_lora(self, slot: int, request, adapter=None) -> None:
        """Put an adapter in a LoRA slot, on every rank: rank 0 from the copy its requests hold (read when they were
        checked, so a step never reads a file), the workers from their own read of it; each keeps its shard."""
        if self.driver is not None:
            self.driver.call("install_lora", slot, request)
        install(self.model, self.lora.layers, slot, adapter if adapter is not None else self.lora.check(request))

    def _encode_missing(self, batch: SchedulerOutput, slot_of: dict[int, int]) -> None:
        """Run the vision tower once, in one packed batch, over every image this step needs and the cache lacks;
        each image's patch rows under its request's vision adapter (slot_of: the step's slots), if any."""
        missing = self.encoder_cache.missing(batch)
        if not missing:
            return
        items = [item for item, _ in missing.values()]
        pixel_values = torch.cat([item.data["pixel_values"] for item in items]).to(self.device, self.dtype)
        grid_thw = torch.stack([item.data["grid_thw"] for item in items])
        patch_slots = torch.cat([torch.full((item.data["pixel_values"].shape[0],), -1 if lora is None else
                                            slot_of[lora.lora_int_id], dtype=torch.long)
                                 for item, lora in missing.values()])
        groups = step_groups(patch_slots, self.device)
        with self.ctx.stepping(ForwardContext.encoder_pass(groups)) if groups is not None else nullcontext():
            outputs = self.model.encode_images(pixel_values, grid_thw)
        for key, item, output in zip(missing, items, outputs):
            if output[0].shape[0] != item.length:
                raise RuntimeError(f"the vision tower returned {output[0].shape[0]} embeddings for an image with "
                                   f"{item.length} placeholder tokens (the checkpoint's merge size disagrees with "
                                   "its preprocessor?)")
            self.encoder_cache.put(key, output)
        self.num_images_encoded += len(items)

    def _multimodal_inputs(self, batch: SchedulerOutput, num_tokens: int, slot_of: dict[int, int]) -> dict:
        """mm_mask [T], mm_embeds and deepstack_embeds rows for the image tokens of this step (EncoderCache.step_rows),
        encoding the images not yet cached first."""
        if not any(seq.mm_items for seq in batch.seqs):
            return {}
        self._encode_missing(batch, slot_of)
        return self.encoder_cache.step_rows(batch, num_tokens)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The model on this rank's shard: hidden states, then logits of the wanted rows (None if none wanted) and
        the pooled rows (None if no pooling request ends this step). Every rank runs it on the same inputs; the
        layers' collectives keep them in step (the pooled rows need none: the hidden states are whole on every
        rank)."""
        dev = self.device
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden_states = self.graphs.run(inputs)
        else:
            step = ForwardContext(
                slot_mapping=inputs.slot_mapping.to(dev),
                cu_seqlens_q=inputs.cu_seqlens_q.to(dev),
                seq_lens=inputs.seq_lens.to(dev),
                block_tables=inputs.block_tables.to(dev),
                decode_only=inputs.decode_only,
                lora=step_groups(inputs.lora_slots, dev) if inputs.lora_slots is not None else None,
            )
            mm_inputs = {k: v.to(dev) for k, v in inputs.mm_inputs.items()}
            with self.ctx.stepping(step):
                hidden_states = self.model(inputs.input_ids.to(dev), inputs.positions.to(dev), **mm_inputs)
        pooled = None
        if inputs.pool_indices is not None and len(inputs.pool_indices):
            pooled = hidden_states[inputs.pool_indices.to(dev)]
            classifier = getattr(self.model, "classifier", None)  # a reranker: its label rows, no vocabulary matmul
            pooled = classifier(pooled) if classifier is not None else pooled
        if not inputs.compute_logits:
            return None, pooled
        if inputs.logits_indices is not None:
            hidden_states = hidden_states[inputs.logits_indices.to(dev)]
        return self.model.compute_logits(hidden_states), pooled

    def _run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.driver is None:
            return self.forward(inputs)
        with self.driver.step(inputs):  # sent (tensors as CPU bytes); rank 0 then runs its own share
            return self.forward(inputs)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, sample_tokens: bool = True):
        """Run one step. Returns [(seq, token ids, their logprobs or None)] for sequences that finished their chunk
        (one token, or accepted proposals and one more: engine/sampler.py),
        [(seq, prompt position, {token: (logprob, rank)})] for the prompt logprobs this step computed, and
        [(seq, pooled row on the host)] for the pooling requests whose prefill ended."""
        inputs, sample_seqs, prompt_rows, pool_seqs = self.prepare(batch)
        inputs.compute_logits = sample_tokens and bool(sample_seqs or prompt_rows)
        # Structured-output masks depend only on tokens already consumed. While an accelerator runs the forward they
        # are computed on the grammar's mask thread, then collected. On the CPU the forward's threads already hold
        # every core and a mask thread beside them only slows them down (bench/throughput.py --structured, 2
        # cores: 4-8% overhead overlapped against 0-4% after the forward), so there they are computed after it.
        constrained = [i for i, seq in enumerate(sample_seqs) if seq.grammar_matcher is not None]
        matchers = [sample_seqs[i].grammar_matcher for i in constrained]
        overlap = inputs.compute_logits and constrained and self.device.type != "cpu"
        masks = self.grammar_matchers.start_bitmask(matchers) if overlap else None
        try:
            logits, pooled = self._run(inputs)
        finally:
            mask_rows = masks.result() if masks is not None else None
        pooled_rows = list(zip(pool_seqs, pooled.float().cpu())) if pooled is not None and sample_tokens else []
        if logits is None:
            return [], [], pooled_rows
        prompt_entries = []
        if prompt_rows:
            entries = prompt_logprob_entries(logits[:len(prompt_rows)], [s.token_ids[j] for s, j in prompt_rows],
                                             [s.sampling_params.prompt_logprobs for s, _ in prompt_rows])
            prompt_entries = [(seq, j, entry) for (seq, j), entry in zip(prompt_rows, entries)]
            logits = logits[len(prompt_rows):]
        if not sample_seqs:
            return [], prompt_entries, pooled_rows
        if constrained and mask_rows is None:
            mask_rows = self.grammar_matchers.fill_bitmask(matchers)
        bitmask = (constrained, mask_rows) if constrained else None
        tokens, logprobs = sample(logits, sample_seqs, self.eos_token_ids, bitmask, self.ctx.ops.apply_token_bitmask)
        return list(zip(sample_seqs, tokens, logprobs)), prompt_entries, pooled_rows

    @torch.inference_mode()
    def prompt_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled position, on the host (for tests and scoring); writes KV like a normal step."""
        inputs, _, _, _ = self.prepare(batch)
        inputs.logits_indices = None
        return self._run(inputs)[0].cpu()

    def describe(self) -> dict:
        """What this rank holds: parameter shapes and bytes (a linear's weight packed in panels by its [out, in]
        shape as loaded), KV pool, checkpoint bytes it read."""
        loaded = {f"{name}.weight": (m.output_size, m.input_size) for name, m in self.model.named_modules()
                  if isinstance(m, LinearBase)}
        params = {name: (loaded[name] if p.dim() > 2 and name in loaded else tuple(p.shape),
                         p.numel() * p.element_size()) for name, p in self.model.named_parameters()}
        kv = self.kv_cache
        return {"device": str(self.device), "params": params, "param_bytes": sum(b for _, b in params.values()),
                "kv_cache_shape": tuple(kv.shape) if kv is not None else None,
                "kv_cache_bytes": sum(t.numel() * t.element_size() for t in (kv, self.kv_scales) if t is not None),
                "checkpoint_bytes_read": getattr(self.model, "checkpoint_bytes_read", None)}

    def describe_all(self) -> list[dict]:
        """describe() of every rank, in rank order (rank 0's alone without tensor parallelism)."""
        if self.driver is None:
            return [self.describe()]
        self.driver.call("describe")
        return self.driver.gather(self.describe())
