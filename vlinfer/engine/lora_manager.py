"""The engine's LoRA adapters: LoRA slots on the model's linear layers, the decoder's and the vision
tower's (layers/lora.py), up to max_loras adapters installed in them for a step, more kept read on
the host in an LRU of up to max_cpu_loras, and each request's adapter checked against the model
before it is queued."""
import logging
import threading
from collections import OrderedDict

import torch

from vlinfer.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from vlinfer.layers.lora import LoRASlots, LoRAStep, lora_groups
from vlinfer.loading.lora import LoRAAdapter, read_peft_adapter
from vlinfer.lora_request import LoRARequest
from vlinfer.models.interfaces import SupportsMultiModal

logger = logging.getLogger("vlinfer")
# Qwen3-VL's vision tower and its mergers, in PEFT's module names and ours alike
# (model.visual.blocks.0.attn.qkv, ...)
VISION_TOWER = "model.visual."


def lora_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    """The linear layers adapters may target on this rank: the language model's and the vision
    tower's (which tensor-parallel rank 0 alone holds)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


def _held_by_another_rank(model: torch.nn.Module, module: str) -> bool:
    """Whether `module` lies in a part this rank does not hold: Qwen3-VL's vision tower on
    tensor-parallel ranks other than 0 (rank 0 checks those modules and runs them)."""
    return (isinstance(model, SupportsMultiModal) and not model.holds_vision_tower
            and module.startswith(VISION_TOWER))


def _sub_outputs(layer: LinearBase) -> list[tuple[int, int]]:
    """(first row, rows) of each sub-projection in this rank's output, in the order targets()
    numbers them."""
    if isinstance(layer, QKVParallelLinear):
        shards = list("qkv")
    elif isinstance(layer, MergedColumnParallelLinear):
        shards = list(range(len(layer.output_sizes)))
    else:
        shards = [None]
    return [layer.output_shard(shard)[1:3] for shard in shards]


def targets(model, adapter: LoRAAdapter,
            layers: dict) -> list[tuple[LinearBase, int, object, torch.Tensor, torch.Tensor]]:
    """(layer, sub-projection index, shard id, lora_A, lora_B) per adapter module, through the
    model's fused-module mapping; ValueError naming a module the model does not have or whose shapes
    do not fit."""
    packed = model.packed_modules_mapping
    out = []
    for module, (a, b) in adapter.modules.items():
        name, shard_id, index = module, None, 0
        for fragment, (fused, shard) in packed.items():
            if module.endswith(f".{fragment}"):
                name = module[:-len(fragment)] + fused
                shard_id, index = shard, "qkv".index(shard) if isinstance(shard, str) else shard
                break
        layer = layers.get(name)
        if layer is None and _held_by_another_rank(model, name):
            continue
        if layer is None:
            raise ValueError(
                f"LoRA adapter {adapter.path!r}: target module {module!r} is not a linear layer of "
                "this "
                "model")
        full_rows = layer.output_shard(shard_id)[4]
        full_cols = layer.input_shard()[2]
        if tuple(a.shape[1:]) != (full_cols,) or b.shape[0] != full_rows:
            raise ValueError(
                f"LoRA adapter {adapter.path!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, this model's layer is {full_rows} x {full_cols} (an "
                "adapter "
                "of another model?)")
        out.append((layer, index, shard_id, a, b))
    return out


class LoRAManager:
    """Rank 0's manager decides which adapter sits in which slot and installs it; under tensor
    parallelism the workers install their shard of the same adapter into the same slot
    (ModelRunner.install_lora)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 zero_slot: bool = False):
        """zero_slot: one slot more, never given an adapter, for the base model's rows of a captured
        graph step (graph_runner: every row there runs some slot)."""
        self.model = model
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.num_slots = max_loras + zero_slot
        self.layers = lora_layers(model)
        for layer in self.layers.values():
            layer.lora = LoRASlots(layer, self.num_slots, max_rank, _sub_outputs(layer))
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        # the step that last used each slot (LRU eviction)
        self.slot_used: list[int] = [0] * max_loras
        self.host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        self.steps = 0
        self.lock = threading.Lock()
        logger.info(
            "LoRA on %d linear layers: %d adapters per step, rank <= %d, %d kept on the host",
            len(self.layers), max_loras, max_rank, max_cpu_loras)
        packed = sum(layer.lora.packed is not None for layer in self.layers.values())
        if self.layers:
            ops = next(iter(self.layers.values())).ops
            logger.info(
                "LoRA slots of %d of %d layers also kept in %s's packed layout (its kernel for "
                "small steps); "
                "the others' updates read the plain slots", packed, len(self.layers), ops.name)

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """Read and validate a request's adapter (in the caller's thread): a clear ValueError naming
        it and why. Callers' threads (the server's) and the engine's step share the host cache: one
        at a time."""
        with self.lock:
            return self._check(request)

    def _check(self, request: LoRARequest) -> LoRAAdapter:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.host.get(request.lora_int_id)
        if known is not None:
            if known[0] != request:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already adapter {known[0].lora_name!r} "
                    "at "
                    f"{known[0].lora_path!r}: one id per adapter")
            self.host.move_to_end(request.lora_int_id)
            return known[1]
        adapter = read_peft_adapter(request.lora_path)
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: rank {adapter.rank} is above max_lora_rank="
                f"{self.max_rank}")
        targets(self.model, adapter, self.layers)
        self.host[request.lora_int_id] = (request, adapter)
        # the least recently used other one not installed goes
        while len(self.host) > self.max_cpu_loras:
            victim = next(
                (i for i in self.host if i not in self.slots and i != request.lora_int_id), None)
            if victim is None:
                break
            del self.host[victim]
        return adapter

    def activate_step(self, seqs, install) -> dict[int, int]:
        """activate() for the adapters of a step's sequences; {} when none runs one."""
        requests = {seq.lora_request.lora_int_id: (seq.lora_request, seq.lora_adapter)
                    for seq in seqs if seq.lora_request}
        return self.activate(requests, install) if requests else {}

    def install(self, slot: int, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Put this rank's shard of an adapter in a slot: rank 0's from the checked copy its
        requests hold (read when they were checked, so a step never reads a file), a worker's from
        its own read of it."""
        adapter = adapter if adapter is not None else self.check(request)
        install(self.model, self.layers, slot, adapter)

    def activate(self, requests: dict[int, tuple[LoRARequest, LoRAAdapter]],
                 install) -> dict[int, int]:
        """Slots for this step's adapters, {lora_int_id: slot} (at most max_loras: the scheduler's
        bound): those installed stay, the least recently used others make room. install(slot,
        request, adapter) puts an adapter in a slot on every rank."""
        self.steps += 1
        ids = set(requests)
        assignment = {
            lora_id: self.slots.index(lora_id)
            for lora_id in ids if lora_id in self.slots
        }
        for lora_id in ids - set(assignment):
            free = [s for s in range(self.max_loras) if self.slots[s] not in ids]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
            install(slot, *requests[lora_id])
            self.slots[slot] = lora_id
            assignment[lora_id] = slot
        for slot in assignment.values():
            self.slot_used[slot] = self.steps
        return assignment

    @staticmethod
    def vision_lora(request: LoRARequest, adapter: LoRAAdapter) -> LoRARequest | None:
        """The adapter a request's images are encoded under (`adapter`: its checked copy): its own
        when it has vision-tower modules, else None (its images are then the base model's, shared
        with every request: Sequence.encoder_key)."""
        return request if any(module.startswith(VISION_TOWER)
                              for module in adapter.modules) else None


def install(model, layers: dict, slot: int, adapter: LoRAAdapter) -> None:
    """Put this rank's shard of `adapter` in `slot` of every layer (the layers it does not target:
    zero)."""
    for layer in layers.values():
        layer.lora.clear(slot)
    for layer, index, shard_id, a, b in targets(model, adapter, layers):
        layer.lora.set_sub(layer, slot, index, shard_id, a, b, adapter.scaling)
    for layer in layers.values():
        layer.lora.repack(slot)


def step_groups(slots: torch.Tensor, device) -> LoRAStep | None:
    """The step's LoRAStep from each token's slot (-1: the base model); None when no token runs an
    adapter."""
    groups = lora_groups(slots, device)
    return None if groups is None else LoRAStep(groups)
