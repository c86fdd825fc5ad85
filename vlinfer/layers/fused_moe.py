"""The sparse mixture-of-experts block (Qwen3-MoE, Qwen3-VL-MoE): a router and E SwiGLU experts
behind one fused op.

Expert weights live fused, in the layout the op takes: w13 [E_local, 2*I_local, H] (each expert's
gate rows, then
its up rows) and w2 [E_local, H, I_local]. Under tensor parallelism there are two ways to split
them:
- sharded (the default): every rank holds every expert, sliced along the intermediate dimension
  (gate/up
  column-parallel, down row-parallel), so each rank's op output is a partial sum;
- expert parallel (ModelContext.expert_parallel): each rank holds E / tp whole experts, and a
  token's share of
  another rank's expert is zero here.
Either way one all-reduce sums the ranks. The router is small and replicated: every rank routes
every token the
same way.

The loaders take checkpoint tensors (or lazy loading.CheckpointSlice objects) and read only this
rank's part: one expert's gate/up/down, or a layer's fused 3-D tensor in either of two layouts,
decided by shape.

Quantized experts (compressed-tensors W8A8 / W8A16 / W4A16, FP8 blocks, one expert projection per
tensor set) open by dequantizing on load: each projection's tensors fill a staging linear layer that
holds the checkpoint's method for it (chosen per projection, as for any linear layer), and once
complete its float weight goes into the fused layout. The fused op then runs dense experts: the
checkpoint opens and equals its dequantized weights, but it is not smaller or faster in memory
(logged; kernels on kept-quantized experts are not built)."""
import torch
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.layers.distributed import divide
from vlinfer.layers.linear import ReplicatedLinear, as_tensor

# Which rows of w13 a per-expert projection fills, and the part index used to track what is loaded.
_PARTS = {"gate": 0, "up": 1, "down": 2}


class FusedMoE(nn.Module):
    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int,
                 num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.ctx = ctx
        self.ops, self.tp = ctx.ops, ctx.tp
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.expert_parallel = ctx.expert_parallel and ctx.tp.size > 1
        if self.expert_parallel:
            if num_experts % ctx.tp.size:
                raise ValueError(
                    f"enable_expert_parallel: num_experts={num_experts} is not divisible by "
                    f"tensor_parallel_size={ctx.tp.size}")
            self.num_local_experts = num_experts // ctx.tp.size
            self.expert_offset = ctx.tp.rank * self.num_local_experts
            self.local_intermediate = intermediate_size
        else:
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.local_intermediate = divide(intermediate_size, ctx.tp.size)
        # the router; name as in the checkpoints
        self.gate = ReplicatedLinear(ctx, hidden_size, num_experts)
        e, i = self.num_local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=ctx.dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=ctx.dtype),
                                      requires_grad=False)
        # The model routes expert tensors here itself (load_expert / load_fused), not
        # loading.load_weights.
        self.w13_weight.loaded_by_owner = self.w2_weight.loaded_by_owner = True
        # (local expert, gate/up/down) already loaded: a checkpoint missing one is an error, not
        # zeros.
        self._loaded = torch.zeros(e, 3, dtype=torch.bool, device="cpu")
        # The checkpoint's quantization (assign_methods sets it) and the staging layers of quantized
        # projections being filled: (global expert, part) -> (staging linear, names of its
        # parameters not yet loaded).
        self.checkpoint_quantization, self.tensor_index, self.checkpoint_prefix = None, None, None
        self._staging: dict[tuple[int, str], tuple[ReplicatedLinear, set[str]]] = {}

    # ---- loading ----

    def _local(self, expert: int) -> int | None:
        """The local index of a global expert id, or None when another rank holds it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"expert {expert} is outside the model's num_experts={self.num_experts}")
        local = expert - self.expert_offset
        return local if 0 <= local < self.num_local_experts else None

    def _rank_slice(self) -> tuple[int, int]:
        """(start, length) of this rank's part of an expert's intermediate dimension."""
        if self.expert_parallel:
            return 0, self.intermediate_size
        return self.tp.rank * self.local_intermediate, self.local_intermediate

    def load_expert(self, expert: int, part: str, loaded) -> None:
        """One expert's projection as the Qwen3-MoE checkpoints store it: gate / up [I, H], down [H,
        I]."""
        if part not in _PARTS:
            raise ValueError(
                f"unknown expert projection {part!r} (expected gate_proj, up_proj or down_proj)")
        h, i = self.hidden_size, self.intermediate_size
        expected = (h, i) if part == "down" else (i, h)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} {part}_proj has shape {tuple(loaded.shape)}, the model expects "
                f"{expected} (hidden_size={h}, moe_intermediate_size={i})")
        local = self._local(expert)
        if local is None:
            return  # another rank's expert: not read at all
        start, length = self._rank_slice()
        if part == "down":
            self.w2_weight.data[local].copy_(loaded.narrow(1, start, length))
        else:
            rows = self.w13_weight.data[local].narrow(0, _PARTS[part] * length, length)
            rows.copy_(loaded.narrow(0, start, length))
        self._loaded[local, _PARTS[part]] = True

    def set_checkpoint_quantization(self, quantization, tensors, prefix: str) -> None:
        """Before loading (quantization/assign.py): the checkpoint's format, its tensor index and
        this layer's checkpoint module name, so each expert projection can be given the method its
        tensors call for."""
        self.checkpoint_quantization, self.tensor_index, self.checkpoint_prefix = \
            quantization, tensors, prefix

    def load_expert_tensor(self, expert: int, part: str, suffix: str, loaded) -> None:
        """One tensor of one expert projection, `...experts.E.{part}_proj.{suffix}`: a dense
        `weight` loads as is; the tensors of a quantized projection are staged until all are in,
        then dequantized into the fused layout."""
        key = (expert, part)
        if self._local(expert) is None:
            return  # another rank's expert: not read at all
        if key not in self._staging:
            h, i = self.hidden_size, self.intermediate_size
            staging = ReplicatedLinear(self.ctx, i, h) if part == "down" else ReplicatedLinear(
                self.ctx, h, i)
            prefix = f"{self.checkpoint_prefix}.experts.{expert}.{part}_proj"
            method = None if self.checkpoint_quantization is None else \
                self.checkpoint_quantization.expert_method_for(staging, prefix, self.tensor_index)
            if method is None:
                if suffix != "weight":
                    raise ValueError(
                        f"{suffix!r} next to a dense expert projection (the checkpoint's "
                        "quantization "
                        "does not quantize it)")
                return self.load_expert(expert, part, loaded)
            staging.set_method(method)
            self._staging[key] = (staging, {name for name, _ in staging.named_parameters()})
        staging, pending = self._staging[key]
        if suffix not in pending:
            raise ValueError(
                f"unexpected tensor {suffix!r} for a {staging.method.describe()} expert projection "
                f"(it holds {sorted(n for n, _ in staging.named_parameters())})")
        param = getattr(staging, suffix)
        param.weight_loader(param, loaded)
        pending.discard(suffix)
        if not pending:
            del self._staging[key]
            self.load_expert(expert, part, staging.method.dequantized_weight(staging))

    def load_fused(self, part: str, loaded) -> None:
        """All experts of the layer in one 3-D tensor, in either layout:
        - transformers' in-memory one (what its save_pretrained writes for Qwen3-VL-MoE): gate_up
          [E, 2I, H] with
          gate rows first, down [E, H, I];
        - the Qwen3-VL-MoE hub checkpoints' transposed one: gate_up [E, H, 2I] with gate columns
          first, down
          [E, I, H].
        The shape decides; when both layouts have the same shape (hidden_size == 2 *
        moe_intermediate_size for
        gate_up, == moe_intermediate_size for down) it cannot, and that is an error rather than a
        guess."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        width = 2 * i if part == "gate_up" else i
        in_memory = (e, width, h) if part == "gate_up" else (e, h, width)
        hub = (e, h, width) if part == "gate_up" else (e, width, h)
        shape = tuple(loaded.shape)
        name = f"experts.{part}_proj"
        if shape not in (in_memory, hub):
            raise ValueError(
                f"{name} has shape {shape}; the model (num_experts={e}, hidden_size={h}, "
                f"moe_intermediate_size={i}) expects {in_memory} (transformers' layout) or {hub} "
                "(the "
                "hub's transposed layout)")
        if in_memory == hub:
            raise ValueError(
                f"{name} has shape {shape}, which is both transformers' layout and the hub's "
                "transposed "
                f"one (hidden_size={h}, moe_intermediate_size={i}): the layout cannot be told apart"
            )
        transposed = shape == hub
        # this rank's whole experts: the only narrowing, read from the file here
        if self.expert_parallel:
            loaded = loaded.narrow(0, self.expert_offset, self.num_local_experts)
        start, length = self._rank_slice()
        # The intermediate dimension of this tensor: rows of [2I, H] / columns of [H, I] in memory;
        # transposed, the other way round. Sharded, each projection is read from the file as this
        # rank's slice of that dimension.
        dim = {("gate_up", False): 1, ("gate_up", True): 2, ("down", False): 2,
               ("down", True): 1}[part, transposed]
        if part == "gate_up":
            for half in (0, 1):  # gate, then up
                block = as_tensor(loaded.narrow(dim, half * i + start, length))
                target = self.w13_weight.data.narrow(1, half * length, length)
                target.copy_(block.transpose(1, 2) if transposed else block)
        else:
            block = as_tensor(loaded.narrow(dim, start, length))
            self.w2_weight.data.copy_(block.transpose(1, 2) if transposed else block)
        parts = [0, 1] if part == "gate_up" else [2]
        self._loaded[:, parts] = True

    def missing_experts(self) -> list[str]:
        """What the checkpoint has not filled, as 'expert 3 down_proj' (global ids)."""
        names = ("gate_proj", "up_proj", "down_proj")
        missing = [
            f"expert {self.expert_offset + e} {names[p]}"
            for e, p in (~self._loaded).nonzero().tolist()
        ]
        missing += [
            f"expert {e} {part}_proj.{name}" for (e, part), (_, pending) in self._staging.items()
            for name in sorted(pending)
        ]
        return missing

    # ---- running ----

    def pack_weight(self) -> bool:
        """The op table's layout for the experts, once after loading; False when it keeps these."""
        packed = self.ops.pack_moe_weights(self.w13_weight, self.w2_weight)
        if packed is None:
            return False
        # The plain weights are freed with the old parameters.
        self.w13_weight, self.w2_weight = (nn.Parameter(w, requires_grad=False) for w in packed)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        out = self.ops.fused_moe(x, router_logits, self.w13_weight, self.w2_weight, self.top_k,
                                 self.renormalize, self.expert_offset)
        return self.tp.all_reduce(out)
