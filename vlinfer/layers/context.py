"""What the layers of one engine share: its op table, its tensor-parallel group and the current
step's attention metadata, and the dtype its parameters are built in. The model runner owns one
ModelContext and passes it to every layer it builds; nothing here is global, so two engines in one
process (or in two threads) never see each other's ops or steps."""
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from vlinfer.layers.distributed import SINGLE, TPGroup
from vlinfer.ops import Backend


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] where each sequence's new tokens start in the packed batch
    seq_lens: torch.Tensor  # [B] KV length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with -1
    decode_only: bool = False
    # layers/lora.py: the step's adapters and their rows; None: no adapter runs
    lora: "LoRAStep | None" = None
    # Hybrid models (layers/linear_attention.py): each sequence's state slot [B] and whether its
    # slot holds its state so far [B] (False on its first chunk, and after a preemption); None for
    # a model without state slots.
    state_slots: torch.Tensor | None = None
    has_state: torch.Tensor | None = None
    # [B+1] each sequence's tokens in the packed batch, a verification's proposals as one chunk
    # with its last token (cu_seqlens_q runs them as one-token attention rows)
    state_cu_seqlens: torch.Tensor | None = None

    @classmethod
    def encoder_pass(cls, lora: "LoRAStep") -> "ForwardContext":
        """The vision tower's pass under adapters: its attention takes its own cu_seqlens and reads
        no KV cache, so it carries the adapters' rows (over the packed patches) and no attention
        metadata."""
        return cls(slot_mapping=None, cu_seqlens_q=None, seq_lens=None, block_tables=None,
                   lora=lora)


@dataclass(eq=False)
class ModelContext:
    ops: Backend
    tp: TPGroup = SINGLE
    step: ForwardContext | None = None  # set by the model runner for the duration of one forward
    # MoE layers: each rank holds whole experts (EngineConfig.enable_expert_parallel) rather than a
    # slice of every expert's intermediate dimension.
    expert_parallel: bool = False
    # The dtype every layer builds its parameters in: the engine's compute dtype. Passed here rather
    # than through torch's default dtype, which is one per process: two engines building at once
    # would see each other's.
    dtype: torch.dtype = torch.float32
    # The dtype K and V are stored in (EngineConfig.kv_cache_dtype resolved); equal to dtype unless
    # compressed.
    kv_cache_dtype: torch.dtype | None = None
    # The dtype linear-attention layers store their recurrent state in
    # (EngineConfig.mamba_ssm_cache_dtype resolved); their ops compute in float32 either way.
    state_dtype: torch.dtype = torch.float32

    @property
    def kv_cache_quantized(self) -> bool:
        return self.kv_cache_dtype is not None and self.kv_cache_dtype != self.dtype

    def forward_context(self) -> ForwardContext:
        if self.step is None:
            raise RuntimeError("attention called outside a model runner step")
        return self.step

    @contextmanager
    def stepping(self, step: ForwardContext):
        """Make `step` the metadata attention reads while one forward runs; cleared after, even on
        error."""
        if self.step is not None:
            raise RuntimeError(
                "a step is already running on this model (one forward at a time per engine)")
        self.step = step
        try:
            yield step
        finally:
            self.step = None

    @contextmanager
    def merging_rows(self, factor: int):
        """Inside, linears run on rows that merge `factor` rows of the step each (the vision tower's
        patch mergers): the step's adapter rows (layers/lora.py) are merged alike. Nothing changes
        when no adapter runs."""
        step = self.step
        if step is None or step.lora is None:
            yield
            return
        self.step = replace(step, lora=step.lora.merged(factor))
        try:
            yield
        finally:
            self.step = step
