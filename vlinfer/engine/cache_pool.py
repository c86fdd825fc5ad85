"""The cache pool: the one owner of a model's cache memory on this rank. Built from cache specs, it
says what each costs (bytes per KV block, bytes per state slot) for engine/sizing.py to decide how
many to hold, allocates them, binds them to the layers that read and write them, and describes
the capacity it holds.

Two kinds of cache memory (docs/design.md "Two kinds of cache memory"):
- paged KV blocks (`PagedKVSpec`): K and V of a group of attention layers, block_size tokens a
  block, grown with the context and shared by prefix; a sequence holds a list of blocks
  (BlockManager).
- per-sequence state slots (`StateSlotSpec`): the fixed-size recurrent state of linear-attention
  layers (hybrid models, docs/hybrid.md), one slot per running sequence whatever its length; the
  block manager hands a sequence its slot (BlockManager.slots). With prefix caching, the slots past
  the live ones hold checkpoints of the state at block boundaries (`copy_slots`).
A pure-attention model asks for one PagedKVSpec; a hybrid model asks for both."""
import logging
import math
from dataclasses import dataclass

import torch

from vlinfer.layers import Attention

logger = logging.getLogger("vlinfer")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_cache_dtype: torch.dtype) -> int:
    """One token's K and V over every layer as stored: the rows, and an int8 cache's per-row
    float32 scales."""
    element = torch.empty((), dtype=kv_cache_dtype).element_size()
    row = head_dim * element + (4 if kv_cache_dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * row


def kv_cache_scales(kv_cache_dtype: torch.dtype, quantized: bool, shape: tuple, device,
                    ops) -> torch.Tensor | None:
    """The scales of a cache stored in another dtype than the compute dtype
    (ops/reference/kv_cache.py): int8, one per token and KV head, written with each row (1.0 under
    a checkpoint's static scales), in the memory order the op table's kernels read; a floating
    cache, one per layer for K and for V, 1.0 until a checkpoint's scales fill them. None for a
    cache of the compute dtype."""
    if not quantized:
        return None
    if kv_cache_dtype == torch.int8:
        return ops.int8_kv_scales(shape, device)
    return torch.ones(*shape[:2], dtype=torch.float32, device=device)


@dataclass(frozen=True, eq=False)
class PagedKVSpec:
    """A group of attention layers whose K and V live in paged blocks, all of one shape (this
    rank's KV heads). quantized: stored in another dtype than the compute dtype, with scales."""
    layers: tuple[Attention, ...]
    dtype: torch.dtype
    quantized: bool = False

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True, eq=False)
class StateSlotSpec:
    """A group of linear-attention layers whose state is fixed-size per sequence (a conv state and
    a recurrent state per layer), held in slots, one per running sequence, not in blocks: it does
    not grow with the context. `shapes`: one layer's state tensors, e.g. ((conv_dim, kernel - 1),
    (v_heads, key_head_dim, value_head_dim)), sized from the config; `dtypes`: the dtype each is
    stored in (float32 for every one when not given). `layers`: the modules the pool binds their
    slots to (their `states`), when built from a model."""
    num_layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...] = ()
    layers: tuple = ()

    def __post_init__(self):
        if not self.dtypes:
            object.__setattr__(self, "dtypes", (torch.float32,) * len(self.shapes))
        if len(self.dtypes) != len(self.shapes):
            raise ValueError(f"state shapes {self.shapes} and dtypes {self.dtypes} differ in "
                             "length")

    @classmethod
    def of_layers(cls, layers) -> "StateSlotSpec":
        """The spec of a hybrid model's state layers (models/interfaces.py HasStateSlots), all of
        one set of shapes and dtypes."""
        kinds = {(tuple(layer.state_shapes), tuple(layer.state_dtypes)) for layer in layers}
        if len(kinds) != 1:
            raise ValueError(
                f"state layers of differing shapes or dtypes {sorted(map(str, kinds))}")
        shapes, dtypes = kinds.pop()
        return cls(len(layers), shapes, dtypes, tuple(layers))

    @property
    def bytes_per_slot(self) -> int:
        return self.num_layers * sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                                     for shape, dtype in zip(self.shapes, self.dtypes))


class CachePool:
    """This rank's cache memory. Every rank sizes and allocates the same number of blocks (block
    tables come from rank 0), each of its own KV heads only: bytes are per rank.
    num_dummy_blocks: blocks past those the block manager hands out, where padded graph rows write
    (graph_runner.dummy_blocks); the budget covers them."""

    def __init__(self, specs: list, block_size: int, device: torch.device, ops,
                 num_dummy_blocks: int = 0):
        kv = [spec for spec in specs if isinstance(spec, PagedKVSpec)]
        if len(kv) != 1:  # one attention group today; a hybrid's several would each get a tensor
            raise ValueError(f"a cache pool takes one paged KV spec, got {len(kv)}")
        self.kv = kv[0]
        self.states = [spec for spec in specs if isinstance(spec, StateSlotSpec)]
        self.block_size, self.device, self.ops = block_size, device, ops
        self.num_dummy_blocks = num_dummy_blocks
        self.kv_cache: torch.Tensor | None = None  # [2, layers, blocks, block_size, heads, dim]
        self.kv_scales: torch.Tensor | None = None  # with a quantized cache: kv_cache_scales
        self.dummy_block: int | None = None  # the first block past the block manager's
        # per state spec, one tensor per shape: [layers, slots, *shape]
        self.state_tensors: list[list[torch.Tensor]] = []
        self.num_slots = 0
        if self.kv.quantized:
            self._log_readers()
        for spec in self.states:
            self._log_state_readers(spec)

    def _log_readers(self) -> None:
        """Which scales a cache stored in another dtype uses; which kernels write and read it."""
        stored, ops = self.kv.dtype, self.ops
        if all(layer.static_kv_scales is not None for layer in self.kv.layers):
            logger.info("KV cache in %s with the checkpoint's static scales (%s)", stored,
                        "fp8: k_scale / v_scale per layer" if stored != torch.int8 else
                        "int8: K's scales on the query, V's on the output")
        elif stored in (torch.float8_e4m3fn, torch.float8_e5m2):
            logger.warning("KV cache in %s: the checkpoint has no k_scale / v_scale, so both are "
                           "1.0 (as vLLM does)", stored)
        if stored in ops.kv_cache_kernels:
            logger.info("KV cache in %s: %s kernels write it and read it", stored, ops.name)
        else:
            logger.warning("KV cache in %s: %s has no kernel that reads it; its writes and "
                           "attention run the pure-torch reference (ops/reference/kv_cache.py)",
                           stored, ops.name)

    def _log_state_readers(self, spec: StateSlotSpec) -> None:
        """A state dtype this table's linear-attention kernels do not take runs the reference
        (ops/reference/linear_attention.py): said once, at load."""
        kernels = self.ops.state_cache_kernels
        for dtype in spec.dtypes[1:]:  # the recurrent state's (the conv state's is the compute one)
            if kernels and dtype not in kernels:
                logger.warning(
                    "state cache: recurrent state in %s; %s's linear-attention decode kernels "
                    "take %s only, so decode steps run the reference for it "
                    "(ops/reference/linear_attention.py)", str(dtype).removeprefix("torch."),
                    self.ops.name, "/".join(str(d).removeprefix("torch.") for d in kernels))

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def layers(self) -> tuple[Attention, ...]:
        return self.kv.layers

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.kv.bytes_per_token

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state over every state spec: 0 for a pure-attention model."""
        return sum(spec.bytes_per_slot for spec in self.states)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now, scales included."""
        tensors = [self.kv_cache, self.kv_scales, *(t for ts in self.state_tensors for t in ts)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def allocate(self, num_blocks: int, num_slots: int = 0) -> None:
        """num_blocks for the block manager (plus the dummy blocks) and, for a hybrid model,
        num_slots state slots (one per sequence it may run), bound to the layers."""
        if self.states and num_slots < 1:
            raise ValueError("a hybrid model's cache pool needs at least one state slot")
        self.release()  # an old pool (the profiling one), views included, goes before the new one
        # Empty, not zeroed: untouched pages cost no RAM, so a generous pool only occupies what
        # requests use. Every attention path reads only slots below each sequence's length (the
        # reference masks the padding it gathers), so stale slots never reach an output.
        kv = self.kv
        shape = (2, len(kv.layers), num_blocks + self.num_dummy_blocks, self.block_size,
                 kv.num_kv_heads)
        self.kv_cache = torch.empty(*shape, kv.head_dim, dtype=kv.dtype, device=self.device)
        self.kv_scales = kv_cache_scales(kv.dtype, kv.quantized, shape, self.device, self.ops)
        self.dummy_block = num_blocks if self.num_dummy_blocks else None
        for i, layer in enumerate(kv.layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
                if layer.static_kv_scales is not None and kv.dtype != torch.int8:  # fp8's pair
                    layer.k_scale.fill_(layer.static_kv_scales.k_scale)
                    layer.v_scale.fill_(layer.static_kv_scales.v_scale)
        # Zeroed: a slot's state is only read where has_state says it was written, but a stray
        # read of garbage could be NaN where zeros are harmless.
        self.num_slots = num_slots if self.states else 0
        for spec in self.states:
            # the conv state, then the recurrent state in the order the op table's kernels read
            lead = (spec.num_layers, num_slots)
            tensors = [torch.zeros(*lead, *spec.shapes[0], dtype=spec.dtypes[0],
                                   device=self.device)]
            tensors += [self.ops.recurrent_state_pool((*lead, *shape), dtype, self.device)
                        for shape, dtype in zip(spec.shapes[1:], spec.dtypes[1:])]
            self.state_tensors.append(tensors)
            for i, layer in enumerate(spec.layers):
                layer.states = tuple(t[i] for t in tensors)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slots (source, destination) in every state tensor: a prefix hit's checkpoint
        into its sequence's slot, a sequence's state into a checkpoint. Sources and destinations
        are disjoint (live slots one side, checkpoint slots the other)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for tensors in self.state_tensors:
            for t in tensors:
                t.index_copy_(1, dst, t.index_select(1, src))

    def snapshot_slots(self, slots: list[int]) -> list[torch.Tensor]:
        """A copy of these slots' states (every state tensor, slots in this order): a
        verification's starting states, kept for the step (engine/model_runner.py)."""
        index = torch.tensor(slots, device=self.device)
        return [t.index_select(1, index) for tensors in self.state_tensors for t in tensors]

    def restore_slots(self, snapshot: list[torch.Tensor], positions: list[int],
                      slots: list[int]) -> None:
        """Put back the states at `positions` of a snapshot_slots copy into their `slots`."""
        if not slots:
            return
        src = torch.tensor(positions, device=self.device)
        dst = torch.tensor(slots, device=self.device)
        live = [t for tensors in self.state_tensors for t in tensors]
        for t, saved in zip(live, snapshot):
            t.index_copy_(1, dst, saved.index_select(1, src))

    def release(self) -> None:
        """Drop the pool and the layers' views of it."""
        self.kv_cache = self.kv_scales = None
        self.dummy_block = None
        self.state_tensors, self.num_slots = [], 0
        for spec in self.states:
            for layer in spec.layers:
                layer.states = ()
        for layer in self.kv.layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
            layer.k_scale = layer.v_scale = None

    def capacity(self, num_blocks: int, per_rank: str = "") -> str:
        """The capacity of num_blocks, for the sizing log: blocks, dtype, bytes, tokens."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{num_blocks} blocks of {self.block_size} tokens in {dtype} "
                f"({num_blocks * self.bytes_per_block / 2 ** 20:.1f} MiB{per_rank}, "
                f"{num_blocks * self.block_size} tokens)")

    def slot_capacity(self, num_slots: int, per_rank: str = "", num_checkpoints: int = 0) -> str:
        """The capacity of num_slots state slots (and num_checkpoints checkpoint slots of the
        same size), for the sizing log."""
        # per spec, each tensor's dtype in the order of its shapes: conv / recurrent
        dtypes = sorted({"/".join(str(d).removeprefix("torch.") for d in spec.dtypes)
                         for spec in self.states})
        checkpoints = (f" + {num_checkpoints} prefix-cache checkpoints "
                       f"({num_checkpoints * self.bytes_per_slot / 2 ** 20:.1f} MiB{per_rank})"
                       if num_checkpoints else "")
        return (f"{num_slots} state slots in {', '.join(dtypes)} "
                f"({num_slots * self.bytes_per_slot / 2 ** 20:.1f} MiB{per_rank}, "
                f"{self.bytes_per_slot / 2 ** 20:.2f} MiB a sequence){checkpoints}")
