"""Pure-torch reference ops. They define what each op means; device kernels must match them.

`ReferenceOps` is the op table an engine holds when no device kernel applies, and the base class of every device
implementation (ops/cpu.py, cuda.py, npu.py): an implementation overrides the ops it has kernels for, and the others
stay on these definitions. One instance per engine, so two engines in a process never share an op table or the
state an implementation keeps (loaded kernels, per-step caches)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlinfer.ops import gguf_reference, kv_quant_reference, moe_reference, quant_reference, token_bitmask_reference


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged cache [num_blocks, block_size, kv_heads, head_dim]
    at flat slot indices; slots < 0 are padding and are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, kv_heads, head_dim] view of one sequence's paged KV."""
    num_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of packed queries q [T, heads, head_dim] over each sequence's paged KV.

    Sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1], which are its last tokens: query j of a chunk of
    length n sits at absolute position seq_lens[i] - n + j and sees keys 0..that position. Any mix of prefill
    chunks (with or without a cached prefix) and single-token decodes is valid in one call.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    kv_lens = seq_lens.tolist()
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        # Single-token queries batch into one padded call: [B, kv_heads, group, D] against [B, kv_heads, L, D].
        # Explicit matmuls beat SDPA here (its CPU kernel is tuned for long queries); softmax runs in float32.
        rows = torch.tensor(decode_rows, device=q.device)
        block_size = k_cache.shape[1]
        max_len = max(kv_lens[i] for i in decode_rows)
        max_blocks = (max_len + block_size - 1) // block_size
        length = max_blocks * block_size
        flat = block_tables[rows, :max_blocks].clamp_min(0).flatten()
        b = len(decode_rows)
        k = k_cache.index_select(0, flat).view(b, length, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        v = v_cache.index_select(0, flat).view(b, length, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        token_index = cu_seqlens_q[rows]
        qd = q[token_index].view(b, num_kv_heads, group, head_dim)
        scores = torch.matmul(qd, k.transpose(-1, -2)).float().mul_(scale)
        beyond = torch.arange(length, device=q.device)[None, :] >= seq_lens[rows][:, None]
        scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
        # Padding slots may hold uninitialized memory (NaN): zero weight times NaN would still be NaN.
        v = v.masked_fill(beyond[:, None, :, None], 0)
        o = torch.matmul(scores.softmax(-1).to(v.dtype), v)
        out[token_index] = o.reshape(b, num_heads, head_dim)
    prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
    return out


def quantized_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                              v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention over a cache stored in another dtype than q's (kv_quant_reference.py says how it reads):
    the blocks the tables name are read back in q's dtype and attended as a cache of the compute dtype."""
    k, v, tables = kv_quant_reference.dequantized_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, q.dtype)
    return paged_attention(q, k, v, cu_seqlens_q, seq_lens, tables, scale)


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out,
                      chunk_over_context=None) -> None:
    """The multi-token rows of paged_attention (prefill chunks), one causal call per sequence, written to out.
    chunk_over_context(q [heads, n, d], k, v [kv_heads, kv_len, d], scale): how a chunk after a cached context is
    attended where an op table has a faster way than the masked call below (ops/cpu_prefill.py)."""
    group = q.shape[1] // k_cache.shape[2]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts = cu_seqlens_q[:-1].tolist()
    kv_lens = seq_lens.tolist()
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        kv_len = kv_lens[i]
        k = _gather_kv(k_cache, block_tables[i], kv_len).transpose(0, 1)
        v = _gather_kv(v_cache, block_tables[i], kv_len).transpose(0, 1)
        qs = q[starts[i]:starts[i] + n].transpose(0, 1)
        if n == kv_len:  # no cached context: plain causal, which lets SDPA skip the masked half of the blocks
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        elif chunk_over_context is not None:
            o = chunk_over_context(qs, k, v, scale)
        else:
            # Query j may see keys up to kv_len - n + j: a causal mask shifted by the cached context.
            q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[starts[i]:starts[i] + n] = o.transpose(0, 1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within each packed segment: q, k, v [T, heads, head_dim], segments cu_seqlens."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (norm(x + residual), x + residual): the fused pre-norm step of a decoder layer."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU (gelu_pytorch_tanh). Implementations may overwrite x: callers pass a temporary."""
    return F.gelu(x, approximate="tanh")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style rotary on q [T, heads, D] and k [T, kv_heads, D] with cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    q_out = (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype)
    k_out = (k.float() * cos + rotate_half(k.float()) * sin).to(k.dtype)
    return q_out, k_out


@dataclass(frozen=True, eq=False)
class LoRAGroups:
    """One step's tokens that run a LoRA adapter, grouped by slot: what add_lora reads, built once per step
    (lora_groups) and shared by every LoRA layer. Slot s's tokens are rows[offsets[s]:offsets[s + 1]].

    rows: int64 [N] token indices on the device, by slot ascending and in token order within a slot; None when one
    adapter covers every token of the step (N = T, the rows are 0..T-1: nothing to gather).
    offsets: int64 [S + 1] on the device, cumulative row counts of slots 0..S-1, S = the highest slot used + 1 (a
    slot with no row has an empty range): the segment bounds a grouped GEMM or a kernel reads without a host sync.
    segments: (slot, start, count) on the host for each slot with rows, slot ascending; None in a captured graph's
    step (captured_lora_groups), whose grouping only the device holds.
    token_slots: int64 [T] on the device, each token's slot (-1: the base model), for kernels that mask instead of
    gathering.
    max_rows: the most rows of one slot, or a bound on it (host): a kernel's grid."""
    rows: torch.Tensor | None
    offsets: torch.Tensor
    segments: tuple[tuple[int, int, int], ...] | None
    token_slots: torch.Tensor
    max_rows: int

    def host_segments(self) -> tuple[tuple[int, int, int], ...]:
        """segments, for implementations that group on the host; a captured step has none to give."""
        if self.segments is None:
            raise ValueError("LoRA groups of a captured graph step have no host segments: only a device-side add_lora "
                             "(CUDA, NPU) runs them")
        return self.segments

    def merged(self, factor: int) -> "LoRAGroups":
        """The same groups over rows merged `factor` to one, when each slot's rows are whole aligned runs of
        `factor` (a run's first row names its merged row): the vision tower's patch mergers. No host sync."""
        rows = None if self.rows is None else self.rows[::factor] // factor
        return LoRAGroups(rows, self.offsets // factor,
                          tuple((slot, start // factor, count // factor) for slot, start, count in self.segments),
                          self.token_slots[::factor], self.max_rows // factor)


def lora_groups(slots: torch.Tensor, device) -> LoRAGroups | None:
    """The step's LoRAGroups from each token's slot (a host tensor, -1: the base model); None when no token runs an
    adapter."""
    used = (slots >= 0).nonzero().flatten()
    if not used.numel():
        return None
    counts = torch.bincount(slots[used])
    offsets = F.pad(counts.cumsum(0), (1, 0))
    segments = tuple((s, int(offsets[s]), int(counts[s])) for s in counts.nonzero().flatten().tolist())
    whole = len(segments) == 1 and used.numel() == slots.numel()
    rows = None if whole else used[torch.argsort(slots[used], stable=True)].to(device)
    return LoRAGroups(rows, offsets.to(device), segments, slots.to(device), int(counts.max()))


def captured_lora_groups(slots: torch.Tensor, num_slots: int) -> dict[str, torch.Tensor]:
    """A captured graph step's grouping (host tensors the graph runner copies into its static buffers): every row
    in a slot, the base model's and padding rows (-1) in slot num_slots - 1, which the engine keeps zero (its update
    adds 0), so the shapes are the bucket's whatever the adapters. rows [T], offsets [num_slots + 1], token_slots
    [T]."""
    slots = slots.masked_fill(slots < 0, num_slots - 1)
    offsets = F.pad(torch.bincount(slots, minlength=num_slots).cumsum(0), (1, 0))
    return dict(rows=torch.argsort(slots, stable=True), offsets=offsets, token_slots=slots)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             groups: LoRAGroups, packed=None) -> torch.Tensor:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for each token t of slot s in groups, in place; returns y.

    x [T, in], y [T, out] (the base layer's output); lora_a [max_loras, R, in], lora_b [max_loras, out, R], the
    slots' shrink and expand (layers/lora.py: R = n_sub * max_rank, the scaling folded into lora_b). The shrink is
    rounded to x's dtype before the expand. Tokens of no slot keep y. packed: an implementation's own copy of the
    same slots (its pack_lora; None here)."""
    for slot, start, count in groups.host_segments():
        a, b = lora_a[slot], lora_b[slot]
        if groups.rows is None:
            y.add_((x @ a.T) @ b.T)
        else:
            rows = groups.rows[start:start + count]
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
    return y


class ReferenceOps:
    """The op table layers call through their engine's ModelContext. Subclasses override ops and may keep state
    (a loaded extension, per-step caches); the reference keeps none."""
    name = "reference"

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    store_kvcache = staticmethod(store_kvcache)
    paged_attention = staticmethod(paged_attention)
    # A KV cache in another dtype than the compute dtype (EngineConfig.kv_cache_dtype): written quantized, read back
    # dequantized. kv_cache_kernels names the cache dtypes an implementation reads in its own kernels; for the
    # others these reference definitions run, and the model runner's start-up log says so.
    store_quantized_kvcache = staticmethod(kv_quant_reference.store_quantized_kvcache)
    quantized_paged_attention = staticmethod(quantized_paged_attention)
    kv_cache_kernels: tuple = ()

    def int8_kv_scales(self, shape: tuple, device) -> torch.Tensor:
        """An int8 KV pool's row scales, 1.0, indexed [..., num_blocks, block_size, kv_heads] (kv_quant_reference):
        contiguous here; an implementation whose kernels read them in another memory order returns a view of it."""
        return torch.ones(*shape, dtype=torch.float32, device=device)
    apply_rotary = staticmethod(apply_rotary)
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    gelu_tanh = staticmethod(gelu_tanh)
    varlen_attention = staticmethod(varlen_attention)
    linear = staticmethod(linear)
    fused_moe = staticmethod(moe_reference.fused_moe)
    apply_token_bitmask = staticmethod(token_bitmask_reference.apply_token_bitmask)
    # LoRA: each token's adapter update after the base layer, grouped by adapter slot (layers/lora.py).
    add_lora = staticmethod(add_lora)

    def pack_lora(self, lora_a: torch.Tensor, lora_b: torch.Tensor, sub_outputs: list[tuple[int, int]]):
        """This table's own layout of a layer's LoRA slots (lora_a / lora_b as add_lora takes them, all zero;
        sub_outputs: each sub-projection's (first output row, rows), layers/lora.py), passed back to add_lora as
        `packed` and refreshed by repack_lora when a slot changes; None where add_lora reads the plain slots (the
        reference, CUDA, NPU)."""
        return None

    def repack_lora(self, packed, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Copy `slot` of the plain slots into `packed` (pack_lora's), after an adapter was installed there."""

    def pack_moe_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        """(w13, w2) in the layout this implementation's `fused_moe` runs fastest on, or None to keep them as they
        are. MoE layers call it once after loading; `fused_moe` then receives what it returned."""
        return moe_reference.pack_moe_weights(w13, w2)

    # Quantized linears (definitions in quant_reference.py): each receives what pack_quantized_linear returned.
    w8a8_dynamic_linear = staticmethod(quant_reference.w8a8_dynamic_linear)
    w8a8_static_linear = staticmethod(quant_reference.w8a8_static_linear)
    weight_only_linear = staticmethod(quant_reference.weight_only_linear)

    def pack_quantized_linear(self, scheme: str, tensors: dict) -> dict:
        """A quantized linear's tensors (quant_reference's canonical layout) laid out for this implementation's
        quantized ops, once after loading. An implementation that changes the layout overrides those ops too."""
        return quant_reference.pack_quantized_linear(scheme, tensors)

    # GGUF Q8_0 / Q4_0 / Q4_1 weights in their blocks (definitions in gguf_reference.py).
    gguf_linear = staticmethod(gguf_reference.gguf_linear)
    gguf_embedding = staticmethod(gguf_reference.gguf_embedding)

    def pack_gguf_weight(self, weight: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        """A GGUF block weight laid out for this implementation's gguf_linear (None: it runs on the file's blocks,
        the reference dequantizing them on every call)."""
        return None

    def pack_linear_weight(self, weight: torch.Tensor, large_rows: bool = False) -> torch.Tensor | None:
        """The weight in the layout this implementation's `linear` runs fastest on, or None to keep it as it is.
        Layers call it once after loading (build_model.pack_weights); ops never see the layers themselves.
        large_rows: the layer only ever runs prefill-sized row counts (a vision tower's)."""
        return None

    def dense_decode_stack(self, layers: list[dict], num_heads: int, num_kv_heads: int, head_dim: int,
                           scale: float, eps: float, qk_eps: float):
        """An object whose forward(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens) runs a
        dense model's decoder layers for a decode step (one token per sequence) in one call and returns the last
        layer's (mlp output, residual); or None, and the layers run module by module. `layers`: per layer its
        packed weights by name (LlamaDecoderLayer.decode_weights). Models ask once after packing
        (model_runner.pack_weights); the reference fuses nothing."""
        return None

    def describe(self) -> str:
        """What runs, for the start-up log line."""
        return self.name

    def __deepcopy__(self, memo):
        # A model copied deep (e.g. to cast a copy to another dtype) still runs on its engine's op table: loaded
        # kernels are not data to duplicate.
        return self
