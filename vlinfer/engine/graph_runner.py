"""Decode steps replayed from captured graphs (CUDA graphs on CUDA, ACL graphs on the Ascend NPU),
behind EngineConfig.enforce_eager=False.

A decode-only step's shapes depend only on its batch size, so the model's forward is captured once
per bucket of batch sizes (1, 2, 4, 8, 16, ..., up to max_num_seqs, at most MAX_BUCKET) over static
input buffers. A step copies its inputs into the buffers, pads up to the smallest bucket that holds
it and replays; padded rows write nothing (slot -1) and attend to nothing (length 0), or use a
reserved dummy block where the backend asks for one, and their hidden states are cut off. Logits and
sampling run eager on the real rows. Prefill and mixed steps, steps carrying image embeddings,
batches above the largest bucket and contexts longer than the captured block-table width run eager.
With LoRA on, the graphs run the adapters' updates over static buffers (every row in a slot, the
base model's and padding rows in one kept zero), so decode steps with adapters replay as well.
A hybrid model's decode steps replay where its op table's linear-attention ops can be captured
(Backend.state_graph_refusal; the model runner logs why not): the state pools are the engine's
static tensors already, and each step's state slots and has_state are static buffers like the
block tables (cu_seqlens is one token per row, as the attention's); padded rows take slot -1,
which those ops neither read nor write, so no live slot or checkpoint is touched. A step whose
rows are not one token per state sequence (a speculative verification) runs eager.

How a graph is captured and replayed is the op table's answer (Backend.graph_capture,
ops/interface.py): CUDA's records the forward with torch.cuda.CUDAGraph (ops/cuda/graph.py); the
NPU's with torch.npu.NPUGraph, re-issuing its attention tasks with each step's host lengths before a
replay (such a backend sets `host_lengths`) and padding into a dummy block (ops/npu/graph.py).
Buckets, buffers and padding do not depend on it otherwise, so tests run them on CPU with a backend
whose "graph" re-runs the recorded callable on the static buffers
(tests/engine/test_graph_runner.py), or under an emulated torch_npu whose graphs replay what was
captured (tests/ops/npu/test_npu_graph.py).

Graph mode stays off under tensor parallelism: every rank would have to capture and replay in lock
step with the collectives inside the graph, which is not done yet.
"""
import functools
import logging
import math
import time
from collections import Counter

import torch

from vlinfer.layers.context import ForwardContext, ModelContext
from vlinfer.layers.lora import LoRAGroups, LoRAStep, captured_lora_groups
from vlinfer.ops import Backend, GraphModeUnavailable

logger = logging.getLogger("vlinfer")

MAX_BUCKET = 256
# Longest context a captured graph serves when its decode attention gathers the block table's whole
# width (the reference's matmul decode, where Triton cannot load): the static width then bounds the
# memory a replay needs. Longer steps run eager. flash_attn and our Triton kernel read only each
# sequence's own blocks, so with them the graphs serve up to max_model_len.
MAX_CAPTURE_LEN = 8192
# A padded row's state slot: the capturable linear-attention ops read and write nothing for it
# (Backend.state_graph_refusal's contract).
PAD_STATE_SLOT = -1


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below the largest batch, then the largest batch itself: min(max_num_seqs,
    MAX_BUCKET)."""
    top = min(max_num_seqs, MAX_BUCKET)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return sizes + [top]


def select_backend(config, device: torch.device, ops: Backend,
                   kv_cache_dtype: torch.dtype | None = None):
    """The graph backend for this engine, asked of its op table (`ops.graph_capture`), or None to
    run eager; logs which graph mode runs and why. kv_cache_dtype: a cache stored in another dtype
    than the compute dtype, None otherwise."""
    if config.enforce_eager:
        logger.info("graph mode: off (enforce_eager=True), running eager")
        return None
    try:
        backend, unavailable = ops.graph_capture(device), None
    except GraphModeUnavailable as e:
        backend, unavailable = None, e
    has_graphs = backend is not None or unavailable is not None
    if kv_cache_dtype is not None and kv_cache_dtype not in ops.kv_cache_kernels and has_graphs:
        logger.info(
            "graph mode: off, the KV cache in %s is read by the pure-torch reference (it syncs "
            "with the "
            "host), running eager", kv_cache_dtype)
        return None
    if not has_graphs:
        if device.type == "cpu":
            logger.info(
                "graph mode: none on cpu, running eager (torch.compile of the decode step measured "
                "slower "
                "here: bench/cpu_decode_compile.py)")
        else:
            logger.info("graph mode: not implemented for %s yet, running eager", device.type)
        return None
    if config.tensor_parallel_size > 1:
        logger.info("graph mode: off under tensor parallelism (%d ranks), running eager",
                    config.tensor_parallel_size)
        return None
    if unavailable is not None:
        logger.warning("graph mode: graphs unavailable on %s (%s), running eager", device.type,
                       unavailable)
    return backend


class GraphRunner:
    """Captured decode forwards, one per bucket, over one set of static buffers sized for the
    largest bucket. The model's layers read each forward's metadata from `ctx`, the engine's
    ModelContext."""

    def __init__(self, model: torch.nn.Module, ctx: ModelContext, device: torch.device, backend,
                 sizes: list[int], max_blocks: int, uses_mrope: bool,
                 dummy_block: int | None = None, block_size: int = 0, lora_slots: int = 0,
                 state_slots: bool = False):
        """lora_slots: the LoRA layers' slot count, the last one kept zero (LoRAManager zero_slot),
        when adapters are on: every graph then runs the LoRA updates over static groups, and steps
        with adapters replay too; 0: none. state_slots: a hybrid model's (its steps carry each
        row's state slot and has_state)."""
        self.model, self.ctx, self.backend, self.sizes, self.max_blocks = \
            model, ctx, backend, sizes, max_blocks
        self.host_lengths = getattr(backend, "host_lengths", False)
        n = sizes[-1]
        # Padded rows write nothing (slot -1) and attend to nothing (length 0). With a dummy block
        # (reserved by the model runner, dummy_blocks()): row i writes its own slot there and
        # attends to the first one, which the capture warm-up fills (row 0), for kernels that take
        # no -1 slots or empty rows (NPU, npu-ops.md §7.1).
        self.pad_slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.pad_table = torch.full((n, max_blocks), -1, dtype=torch.int32, device=device)
        self.pad_len = 0
        if dummy_block is not None:
            self.pad_slots = dummy_block * block_size + torch.arange(n, device=device)
            self.pad_table[:, 0] = dummy_block
            self.pad_len = 1
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, n) if uses_mrope else (n, ), dtype=torch.long,
                                     device=device)
        self.slot_mapping = self.pad_slots.clone()
        self.seq_lens = torch.full((n,), self.pad_len, dtype=torch.int32, device=device)
        # one token per row, always
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = self.pad_table.clone()
        # A hybrid model's state slot per row (-1: padding, read and written by nobody) and
        # whether it holds the row's state so far.
        self.states = dict(slots=torch.full((n,), PAD_STATE_SLOT, dtype=torch.long, device=device),
                           has_state=torch.zeros(n, dtype=torch.bool, device=device)) \
            if state_slots else None
        # The step's LoRA grouping (layers/lora.py captured_lora_groups), all rows in the zero slot
        # until a step fills it.
        self.lora_slots = lora_slots
        long = dict(dtype=torch.long, device=device)
        self.lora = dict(rows=torch.arange(n, **long), token_slots=torch.zeros(n, **long),
                         offsets=torch.zeros(lora_slots + 1, **long)) if lora_slots else None
        self.graphs: dict[int, object] = {}
        self.replays = Counter()  # bucket -> replays (tests, logs)

    def _forward(self, size: int) -> torch.Tensor:
        lora = None if self.lora is None else LoRAStep(
            LoRAGroups(self.lora["rows"][:size], self.lora["offsets"], None,
                       self.lora["token_slots"][:size], max_rows=size))
        step = ForwardContext(slot_mapping=self.slot_mapping[:size],
                              cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                              seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                              decode_only=True, lora=lora)
        if self.states is not None:  # the linear layers' sequences are the rows: one token each
            step.state_slots, step.has_state = (self.states["slots"][:size],
                                                self.states["has_state"][:size])
            step.state_cu_seqlens = self.cu_seqlens_q[:size + 1]
        with self.ctx.stepping(step):
            return self.model(self.input_ids[:size], self.positions[..., :size])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # largest first: the smaller graphs fit in the memory it pooled
        for size in reversed(self.sizes):
            fn = functools.partial(self._forward, size)
            self._fill_lora(None, size)
            # Warm-up outside capture, on all-padding buffers (nothing is written but the dummy
            # block): Triton compiles, lazy allocations (cuBLAS workspaces) and one-time host work
            # happen here, not in the graph.
            fn()
            # the buffers hold padding rows
            lens = ([self.pad_len] * size,) if self.host_lengths else ()
            self.graphs[size] = self.backend.capture(fn, *lens)
        logger.info(
            "graph mode: %s for decode at batch sizes %s, contexts up to %d blocks (captured in "
            "%.1fs)",
            self.backend.name, self.sizes, self.max_blocks,
            time.perf_counter() - start)

    def can_run(self, inputs) -> bool:
        return (inputs.decode_only and not inputs.mm_inputs and
                inputs.input_ids.shape[0] <= self.sizes[-1] and
                inputs.block_tables.shape[1] <= self.max_blocks and
                inputs.positions.dim() == self.positions.dim() and
                (self.states is None or (inputs.state_slots is not None and
                                         inputs.state_slots.shape[0] == inputs.input_ids.shape[0])))

    def run(self, inputs) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step (can_run), from the smallest bucket that
        holds it."""
        b = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(inputs.input_ids)
        self.input_ids[b:size].zero_()
        self.positions[..., :b].copy_(inputs.positions)
        self.positions[..., b:size].zero_()
        self.slot_mapping[:b].copy_(inputs.slot_mapping)
        # padded rows write no KV, or to the dummy block
        self.slot_mapping[b:size].copy_(self.pad_slots[b:size])
        self.seq_lens[:b].copy_(inputs.seq_lens)
        # ... and attend to nothing, or to the dummy block
        self.seq_lens[b:size].fill_(self.pad_len)
        width = inputs.block_tables.shape[1]
        self.block_tables[:b].fill_(-1)
        self.block_tables[:b, :width].copy_(inputs.block_tables)
        self.block_tables[b:size].copy_(self.pad_table[b:size])
        self._fill_lora(inputs.lora_slots, size)
        if self.states is not None:
            self.states["slots"][:b].copy_(inputs.state_slots)
            self.states["slots"][b:size].fill_(PAD_STATE_SLOT)  # padded rows touch no slot
            self.states["has_state"][:b].copy_(inputs.has_state)
            self.states["has_state"][b:size].fill_(False)
        # inputs are host tensors: their lengths cost no device sync
        lens = (inputs.seq_lens.tolist() + [self.pad_len] *
                (size - b), ) if self.host_lengths else ()
        hidden_states = self.graphs[size].replay(*lens)
        self.replays[size] += 1
        return hidden_states[:b]

    def _fill_lora(self, slots: torch.Tensor | None, size: int) -> None:
        """The LoRA buffers for a step of `size` rows: each real row's slot (slots, a host tensor;
        None: the base model for all), padding in the zero slot."""
        if self.lora is None:
            return
        padded = torch.full((size,), -1, dtype=torch.long)
        if slots is not None:
            padded[:slots.shape[0]] = slots
        for name, value in captured_lora_groups(padded, self.lora_slots).items():
            self.lora[name][:value.shape[0]].copy_(value)


def dummy_blocks(backend, max_num_seqs: int, block_size: int) -> int:
    """KV blocks to reserve past the block manager's for the padded rows' slots: one slot per row of
    the largest bucket (all of its rows are padding at capture; the NPU cache writes want distinct
    slots, §2.1)."""
    if backend is None or not getattr(backend, "pads_to_dummy_block", False):
        return 0
    return math.ceil(batch_sizes(max_num_seqs)[-1] / block_size)


def blocks_for(backend, max_model_len: int, block_size: int, dtype: torch.dtype) -> int:
    """Static block-table width of the captured graphs."""
    reads_only_used = getattr(backend, "reads_only_used_blocks", None)
    if reads_only_used is None or not reads_only_used(block_size, dtype):
        max_model_len = min(max_model_len, MAX_CAPTURE_LEN)
    return math.ceil(max_model_len / block_size)


def capture(model: torch.nn.Module, ctx: ModelContext, device: torch.device, backend,
            max_num_seqs: int, max_model_len: int, block_size: int, mrope: bool,
            dummy_block: int | None, lora_slots: int,
            state_slots: bool = False) -> GraphRunner | None:
    """The decode graphs over the current KV pool for up to max_num_seqs sequences of up to
    max_model_len tokens (state_slots: a hybrid model's); None (eager, logged) where capture
    fails."""
    sizes = batch_sizes(max_num_seqs)
    width = blocks_for(backend, max_model_len, block_size, ctx.dtype)
    graphs = GraphRunner(model, ctx, device, backend, sizes, width, mrope, dummy_block, block_size,
                         lora_slots, state_slots)
    try:
        graphs.capture()
    except Exception as e:  # out of memory after the KV pool, an op that syncs, ...
        logger.warning("graph mode: capture failed (%s: %s), running eager", type(e).__name__,
                       str(e).splitlines()[0][:200] if str(e) else "")
        return None
    return graphs
