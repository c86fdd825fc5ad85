"""Runs the model one step at a time: prepare (the step's inputs) -> run (the forward) -> sample.

It owns the model and the pieces a step uses, each in its own module: the cache pool
(cache_pool.py), the step's inputs (step_inputs.py, a pure function), the vision pass
(vision_encoder.py), the LoRA slots (lora_manager.py) and the decode graphs (graph_runner.py).

Under tensor parallelism every rank has a ModelRunner over its shard of the model and its heads
of the KV pool. Rank 0's runner does everything that needs the requests (scheduling is upstream):
it builds the step's inputs, runs the vision tower for new images, sends the inputs to the
workers (vlinfer/distributed/driver.py), runs its share of the forward alongside them, and
samples. A worker's runner only runs `forward` on what it receives (vlinfer/engine/worker.py)."""
import logging
import math

import torch

from vlinfer import platform
from vlinfer.config import EngineConfig
from vlinfer.engine import graph_runner
from vlinfer.engine.build_model import pack_weights
from vlinfer.engine.cache_pool import CachePool, PagedKVSpec, StateSlotSpec
from vlinfer.engine.encoder_cache import EncoderCache
from vlinfer.engine.lora_manager import LoRAManager, step_groups
from vlinfer.engine.mtp_head import MTPHead, plan_catch_up
from vlinfer.engine.sampler import prompt_logprob_entries, sample
from vlinfer.engine.scheduler import SchedulerOutput, restores_state
from vlinfer.engine.sequence import Sequence
from vlinfer.engine.step_inputs import StepInputs, StepPlan, build_step_inputs
from vlinfer.engine.vision_encoder import VisionEncoder
from vlinfer.layers import Attention, ForwardContext, ModelContext
from vlinfer.layers.linear import LinearBase
from vlinfer.models.interfaces import (HasMTPHead, HasStateSlots, SupportsMRoPE,
                                       SupportsMultiModal)
from vlinfer.structured.reasoning import allow_token

logger = logging.getLogger("vlinfer")


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model: torch.nn.Module, ctx: ModelContext,
                 device: torch.device, block_size: int, eos_token_ids: set[int], driver=None,
                 grammar_matchers=None, checkpoint_bytes_read: int | None = None):
        self.config = config
        self.driver = driver  # rank 0 of a tensor-parallel engine: sends each step to the workers
        # Rank 0's structured-output masks (vlinfer/structured/matchers.py); workers never sample.
        self.grammar_matchers = grammar_matchers
        self.hf_config = hf_config
        self.ctx = ctx  # the model's op table, tensor-parallel group and step metadata
        self.model = model
        self.checkpoint_bytes_read = checkpoint_bytes_read  # build_model.LoadedModel's
        pack_weights(model)  # the op table's weight layout (e.g. oneDNN-packed linears on CPU)
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.mrope = isinstance(model, SupportsMRoPE)
        self.encoder_cache = EncoderCache()
        self.vision = (VisionEncoder(model, ctx, device, self.encoder_cache)
                       if isinstance(model, SupportsMultiModal) and model.holds_vision_tower
                       else None)
        # Decode steps replay captured graphs once capture_graphs() has run (after the KV pool).
        kv_dtype = ctx.kv_cache_dtype or ctx.dtype
        stored = kv_dtype if ctx.kv_cache_quantized else None
        self.graph_backend = graph_runner.select_backend(config, device, ctx.ops, stored)
        self.hybrid = isinstance(model, HasStateSlots)
        if self.hybrid and self.graph_backend is not None:
            # a captured step reads its state slots on the device, where the op table can
            why = ctx.ops.state_graph_refusal(ctx.state_dtype)
            if why is not None:
                logger.info("graph mode: off for this hybrid model (%s), running eager", why)
                self.graph_backend = None
        self.graphs: graph_runner.GraphRunner | None = None
        # LoRA slots on the model's linears (every rank: workers install their shard of each
        # adapter; the vision tower's, on rank 0 alone).
        self.lora = None
        if config.enable_lora:
            self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras,
                                    zero_slot=self.graph_backend is not None)
        attention = tuple(m for m in model.modules() if isinstance(m, Attention))
        dummy = graph_runner.dummy_blocks(self.graph_backend, config.max_num_seqs, block_size)
        specs = [PagedKVSpec(attention, kv_dtype, ctx.kv_cache_quantized)]
        if self.hybrid:  # the linear layers' conv and recurrent states, in the dtypes they say
            specs.append(StateSlotSpec.of_layers(model.state_layers()))
        # The MTP head (speculative_config method "mtp"): its attention layer's K and V are one
        # more layer of the paged pool; the hidden state it reads next, one more state tensor.
        self.mtp = None
        if isinstance(model, HasMTPHead) and model.mtp is not None:
            if not self.hybrid:  # its kept hidden state lives in the state slots
                raise ValueError("speculative_config: method='mtp' runs on hybrid models (Qwen3.5, "
                                 f"Qwen3-Next); {type(model).__name__} has no state slots")
            head = model.mtp
            specs.append(StateSlotSpec(1, head.state_shapes, head.state_dtypes, (head,)))
            self.mtp = MTPHead(model, ctx, device, block_size, self.mrope)
        self.cache_pool = CachePool(specs, block_size, device, ctx.ops, num_dummy_blocks=dummy)

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int) -> int:
        """Peak device memory of one prefill step of num_tokens, with a throwaway cache."""
        seq = Sequence([0] * num_tokens, None)
        seq.block_table = list(range(math.ceil(num_tokens / self.block_size)))
        seq.state_slot = 0 if self.hybrid else None  # a throwaway sequence in a throwaway pool
        self.allocate_kv_cache(len(seq.block_table), 1)
        self.execute(SchedulerOutput([seq], [num_tokens]), sample_tokens=False)
        peak = platform.peak_memory(self.device)
        self.cache_pool.release()
        return peak

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """Every rank allocates the same number of blocks (the block tables come from rank 0), and
        a hybrid model's state slots (its checkpoint slots included)."""
        if self.driver is not None:
            self.driver.call("allocate_kv_cache", num_blocks, num_state_slots)
        self.graphs = None  # captured over the old pool's addresses
        self.cache_pool.allocate(num_blocks, num_state_slots if self.hybrid else 0)

    def init_cache(self, resolved) -> None:
        """The pool `resolved` sized (sizing.py), then the decode graphs over its addresses."""
        self.allocate_kv_cache(resolved.num_blocks,
                               resolved.num_state_slots + resolved.num_checkpoint_slots)
        self.capture_graphs(resolved)  # for the block tables of the resolved length

    def capture_graphs(self, resolved) -> None:
        """Capture the decode graphs over the current KV pool for up to resolved.max_num_seqs
        sequences of up to resolved.max_model_len tokens, when this engine runs graph mode."""
        if self.graph_backend is None:
            return
        self.graphs = graph_runner.capture(
            self.model, self.ctx, self.device, self.graph_backend, resolved.max_num_seqs,
            resolved.max_model_len, self.block_size, self.mrope, self.cache_pool.dummy_block,
            self.lora.num_slots if self.lora else 0, self.hybrid)

    def install_lora(self, slot: int, request, adapter=None) -> None:
        """Put an adapter in a LoRA slot, on every rank; each keeps its shard."""
        if self.driver is not None:
            self.driver.call("install_lora", slot, request)
        self.lora.install(slot, request, adapter)

    def prepare(self, batch: SchedulerOutput) -> tuple[StepInputs, StepPlan]:
        """The step's inputs and plan (step_inputs.py): the step's adapters installed first (the
        vision pass runs under them too), then the images the step reaches encoded."""
        slot_of = self.lora.activate_step(batch.seqs, self.install_lora) if self.lora else {}
        inputs, plan = build_step_inputs(batch.seqs, batch.num_new_tokens, self.block_size,
                                         self.mrope, slot_of)
        inputs.state_restores, inputs.state_saves = batch.state_restores, batch.state_saves
        if self.mtp is not None:
            inputs.mtp_catch_up = plan_catch_up(batch.seqs, batch.num_new_tokens, self.block_size,
                                                self.mrope)
        if self.vision is not None:
            inputs.mm_inputs = self.vision.step_rows(batch, len(inputs.input_ids), slot_of)
        return inputs, plan

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                   torch.Tensor]:
        """The model on this rank's shard: logits of the wanted rows (None if none wanted), the
        pooled rows (None if no pooling request ends this step) and every row's final hidden
        state. Every rank runs it on the same inputs; the layers' collectives keep them in step
        (the pooled rows need none: hidden states are whole on every rank). With an MTP head, its
        catch-up runs before the step's state checkpoints are saved (they keep its hidden row)."""
        dev = self.device
        self.cache_pool.copy_slots(inputs.state_restores)  # prefix hits start from checkpoints
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
                state_slots=_to(inputs.state_slots, dev),
                has_state=_to(inputs.has_state, dev),
                state_cu_seqlens=_to(inputs.state_cu_seqlens, dev),
            )
            mm_inputs = {k: v.to(dev) for k, v in inputs.mm_inputs.items()}
            with self.ctx.stepping(step):
                hidden_states = self.model(inputs.input_ids.to(dev), inputs.positions.to(dev),
                                           **mm_inputs)
            if inputs.mtp_catch_up is not None:
                self.mtp.catch_up(inputs.mtp_catch_up, inputs.input_ids, hidden_states, mm_inputs)
        self.cache_pool.copy_slots(inputs.state_saves)  # the states at block boundaries
        pooled = None
        if inputs.pool_indices is not None and len(inputs.pool_indices):
            pooled = self.model.pool(hidden_states[inputs.pool_indices.to(dev)])
        if not inputs.compute_logits:
            return None, pooled, hidden_states
        rows = hidden_states
        if inputs.logits_indices is not None:
            rows = hidden_states[inputs.logits_indices.to(dev)]
        return self.model.compute_logits(rows), pooled, hidden_states

    def _run(self, inputs: StepInputs):
        if self.driver is None:
            return self.forward(inputs)
        with self.driver.step(inputs):  # sent (tensors as CPU bytes); then rank 0's own share
            return self.forward(inputs)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, sample_tokens: bool = True):
        """Run one step. Returns [(seq, token ids, their logprobs or None)] for sequences that
        finished their chunk (one token, or accepted proposals and one more: engine/sampler.py),
        [(seq, prompt position, {token: (logprob, rank)})] for the prompt logprobs this step
        computed, and [(seq, pooled row on the host)] for the pooling requests whose prefill
        ended."""
        inputs, plan = self.prepare(batch)
        sample_seqs, prompt_rows = plan.sample_seqs, plan.prompt_rows
        inputs.compute_logits = sample_tokens and bool(sample_seqs or prompt_rows)
        # Structured-output masks depend only on tokens already consumed. While an accelerator runs
        # the forward they are computed on the grammar's mask thread, then collected. On the CPU the
        # forward's threads hold every core and a mask thread beside them slows them down
        # (bench/throughput.py --structured), so there they are computed after it.
        constrained = [i for i, seq in enumerate(sample_seqs) if seq.grammar_matcher is not None]
        matchers = [sample_seqs[i].grammar_matcher for i in constrained]
        overlap = inputs.compute_logits and constrained and self.device.type != "cpu"
        masks = self.grammar_matchers.start_bitmask(matchers) if overlap else None
        # A hybrid verification: the slots' states before it, put back where a proposal fails; a
        # slot a prefix hit restores this step starts the forward from its checkpoint (the source)
        verifying = [seq for seq in batch.seqs if seq.spec_token_ids] if self.hybrid else []
        starts = {slot: checkpoint for checkpoint, slot in inputs.state_restores}
        snapshot = self.cache_pool.snapshot_slots(
            [starts.get(s.state_slot, s.state_slot) for s in verifying]) if verifying else None
        try:
            logits, pooled, _ = self._run(inputs)
        finally:
            mask_rows = masks.result() if masks is not None else None
        pooled_rows = (list(zip(plan.pool_seqs, pooled.float().cpu()))
                       if pooled is not None and sample_tokens else [])
        if logits is None:
            return [], [], pooled_rows
        prompt_entries = []
        if prompt_rows:
            entries = prompt_logprob_entries(
                logits[:len(prompt_rows)], [s.token_ids[j] for s, j in prompt_rows],
                [s.sampling_params.prompt_logprobs for s, _ in prompt_rows])
            prompt_entries = [(seq, j, entry) for (seq, j), entry in zip(prompt_rows, entries)]
            logits = logits[len(prompt_rows):]
        if not sample_seqs:
            return [], prompt_entries, pooled_rows
        if constrained and mask_rows is None:
            mask_rows = self.grammar_matchers.fill_bitmask(matchers)
        for row, i in enumerate(constrained):  # an output that may still open its thinking
            reasoning = sample_seqs[i].reasoning
            if reasoning is not None and reasoning.may_open:
                allow_token(mask_rows[row], reasoning.parser.start_token_id)
        bitmask = (constrained, mask_rows) if constrained else None
        tokens, logprobs = sample(logits, sample_seqs, self.eos_token_ids, bitmask,
                                  self.ctx.ops.apply_token_bitmask)
        if snapshot is not None:
            sampled = {seq.seq_id: row for seq, row in zip(sample_seqs, tokens)}
            back = [(i, seq.state_slot) for i, seq in enumerate(verifying)
                    if restores_state(seq, sampled[seq.seq_id])]
            self.cache_pool.restore_slots(snapshot, [i for i, _ in back], [s for _, s in back])
        return list(zip(sample_seqs, tokens, logprobs)), prompt_entries, pooled_rows

    @torch.inference_mode()
    def prompt_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled position, on the host (for tests and scoring); writes KV
        like a step."""
        inputs, _ = self.prepare(batch)
        inputs.logits_indices = None
        return self._run(inputs)[0].cpu()

    def describe(self) -> dict:
        """What this rank holds: parameter shapes and bytes (a linear's weight packed in panels
        by its [out, in] shape as loaded), KV pool, checkpoint bytes it read."""
        loaded = {f"{name}.weight": (m.output_size, m.input_size)
                  for name, m in self.model.named_modules() if isinstance(m, LinearBase)}
        params = {name: (loaded[name] if p.dim() > 2 and name in loaded else tuple(p.shape),
                         p.numel() * p.element_size()) for name, p in self.model.named_parameters()}
        kv = self.cache_pool.kv_cache
        return {"device": str(self.device), "params": params,
                "param_bytes": sum(b for _, b in params.values()),
                "kv_cache_shape": tuple(kv.shape) if kv is not None else None,
                "kv_cache_bytes": self.cache_pool.nbytes,
                "checkpoint_bytes_read": self.checkpoint_bytes_read}

    def describe_all(self) -> list[dict]:
        """describe() of every rank, in rank order (rank 0's alone without tensor parallelism)."""
        if self.driver is None:
            return [self.describe()]
        self.driver.call("describe")
        return self.driver.gather(self.describe())


def _to(tensor: torch.Tensor | None, device) -> torch.Tensor | None:
    return tensor.to(device) if tensor is not None else None
