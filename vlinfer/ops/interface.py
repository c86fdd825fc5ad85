"""The op table's contract: `Backend` declares every op a layer calls (its signature and meaning)
and the questions an engine asks its table (what runs, the KV block size, graph capture). `OPS` and
`QUESTIONS` are derived from the declarations below, so a new op is one `@op` method here, defined
in ops/reference/ and overridden by the devices that have a kernel for it.

A backend (ops/reference/, ops/cpu/, ops/cuda/, ops/npu/) imports this module, ops.reference,
vlinfer.platform and its own package, nothing else; the engine, layers and models see only this
interface and ops.select."""
import torch

# Device types that have a graph mode (ops/cuda/graph.py, ops/npu/graph.py): there an op table that
# cannot be captured is a reason to log, elsewhere graphs are simply not a thing.
GRAPH_DEVICES = ("cuda", "npu")
DEFAULT_BLOCK_SIZE = 16  # KV tokens per block where a backend's kernels ask for nothing else


def op(fn):
    """Marks a Backend method as an op of the table (OPS)."""
    fn.is_op = True
    return fn


class GraphModeUnavailable(RuntimeError):
    """This device has a graph mode, but this op table cannot be captured here (the reason is
    logged)."""


class Backend:
    """One engine's op table for one device. ops.reference.ReferenceOps defines every op in pure
    torch; device tables subclass it and override what they have kernels for. One instance per
    engine: loaded kernels and per-step caches are the instance's, never shared between engines."""
    name = "interface"
    # Cache dtypes (other than the compute dtype) this table's own kernels write and read; the
    # others run the reference definitions (ops/reference/kv_cache.py), and the model runner's
    # start-up log says so.
    kv_cache_kernels: tuple = ()
    # Recurrent-state dtypes (a hybrid model's state slots) this table's own linear-attention
    # kernels read and write; others run the reference, and the cache pool's start-up log says so.
    state_cache_kernels: tuple = ()

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    # ---- KV cache ----

    @op
    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write key/value [T, kv_heads, head_dim] into the paged cache [num_blocks, block_size,
        kv_heads, head_dim] at flat slot indices; slots < 0 are padding and are skipped."""
        raise NotImplementedError

    @op
    def store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale,
                                slot_mapping) -> None:
        """store_kvcache into a cache stored in another dtype, with its scales
        (ops/reference/kv_cache.py)."""
        raise NotImplementedError

    @op
    def int8_kv_scales(self, shape: tuple, device) -> torch.Tensor:
        """An int8 KV pool's row scales, 1.0, indexed [..., num_blocks, block_size, kv_heads], in
        the memory order this table's kernels read."""
        raise NotImplementedError

    # ---- attention ----

    @op
    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                        scale) -> torch.Tensor:
        """Causal attention of packed queries q [T, heads, head_dim] over each sequence's paged KV;
        any mix of prefill chunks, prefix hits and decodes (ops/reference/attention.py)."""
        raise NotImplementedError

    @op
    def quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                                  seq_lens, block_tables, scale) -> torch.Tensor:
        """paged_attention over a cache stored in another dtype than q's, read back with its
        scales."""
        raise NotImplementedError

    @op
    def varlen_attention(self, q, k, v, cu_seqlens, scale) -> torch.Tensor:
        """Bidirectional attention within each packed segment (the vision tower): q, k, v [T, heads,
        head_dim]."""
        raise NotImplementedError

    @op
    def apply_rotary(self, q, k, cos, sin):
        """Neox rotary on q [T, heads, D] and k [T, kv_heads, D] with cos / sin [T, D]; returns (q,
        k)."""
        raise NotImplementedError

    # ---- norms and activations ----

    @op
    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        """RMS norm over the last dim, in float32, scaled by weight."""
        raise NotImplementedError

    @op
    def add_rms_norm(self, x, residual, weight, eps: float):
        """(rms_norm(x + residual), x + residual): a decoder layer's fused pre-norm."""
        raise NotImplementedError

    @op
    def silu_and_mul(self, x) -> torch.Tensor:
        """silu(gate) * up over the two halves of the last dim (a merged gate_up projection)."""
        raise NotImplementedError

    @op
    def gelu_tanh(self, x) -> torch.Tensor:
        """tanh-approximated GELU; may overwrite x (callers pass a temporary)."""
        raise NotImplementedError

    # ---- linear attention of hybrid models (ops/reference/linear_attention.py) ----

    @op
    def causal_conv1d(self, x, weight, bias, conv_state, cu_seqlens, slots,
                      has_state) -> torch.Tensor:
        """Depthwise causal conv [T, C] + SiLU per packed sequence, its left context and its last
        inputs in conv_state[slots[i]] (zeros where not has_state[i])."""
        raise NotImplementedError

    @op
    def gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                         scale: float) -> torch.Tensor:
        """The gated delta rule over packed sequences, each from and into its state slot
        [Hv, Dk, Dv]; q and k L2-normalised inside. Returns o [T, Hv, Dv]."""
        raise NotImplementedError

    @op
    def gated_rms_norm(self, x, gate, weight, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., D] times SiLU(gate): a Gated DeltaNet layer's output norm."""
        raise NotImplementedError

    # ---- dense linears ----

    @op
    def linear(self, x, weight, bias=None) -> torch.Tensor:
        """x @ weight.T + bias, weight as loaded or as pack_linear_weight returned it."""
        raise NotImplementedError

    @op
    def pack_linear_weight(self, weight, large_rows: bool = False):
        """The weight in the layout this table's `linear` runs fastest on, or None to keep it; once
        after loading. large_rows: the layer only runs prefill-sized row counts (a vision
        tower's)."""
        raise NotImplementedError

    @op
    def dense_decode_stack(self, layers: list[dict], num_heads: int, num_kv_heads: int,
                           head_dim: int, scale: float, eps: float, qk_eps: float,
                           kv_cache_dtype: torch.dtype | None = None):
        """An object running a dense model's decoder layers for a decode step in one call
        (forward(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens, k_scales,
        v_scales) -> (mlp output, residual); the scales only for a cache stored in kv_cache_dtype,
        another dtype than the compute dtype), or None. A projection is a dense weight or a
        quantization method's decode_weight dict."""
        raise NotImplementedError

    # ---- mixture of experts ----

    @op
    def fused_moe(self, x, router_logits, w13, w2, top_k: int, renormalize: bool,
                  expert_offset: int = 0) -> torch.Tensor:
        """Route each token to its top-k experts and sum their SwiGLU MLPs
        (ops/reference/moe.py)."""
        raise NotImplementedError

    @op
    def pack_moe_weights(self, w13, w2):
        """(w13, w2) in the layout this table's fused_moe runs fastest on, or None to keep them;
        once."""
        raise NotImplementedError

    # ---- quantized linears (ops/reference/quant.py) ----

    @op
    def w8a8_dynamic_linear(self, x, packed: dict, bias=None) -> torch.Tensor:
        """int8 weights, activations quantized per token on the fly."""
        raise NotImplementedError

    @op
    def w8a8_static_linear(self, x, packed: dict, bias=None) -> torch.Tensor:
        """int8 weights, activations quantized with the checkpoint's static scale and offset."""
        raise NotImplementedError

    @op
    def weight_only_linear(self, x, packed: dict, bias=None) -> torch.Tensor:
        """int8 / int4 weights dequantized against float activations (W8A16 / W4A16)."""
        raise NotImplementedError

    @op
    def pack_quantized_linear(self, scheme: str, tensors: dict) -> dict:
        """A quantized linear's canonical tensors laid out for this table's quantized ops, once
        after loading."""
        raise NotImplementedError

    # ---- GGUF block weights (ops/reference/gguf.py) ----

    @op
    def gguf_linear(self, x, weight, ggml_type: int, bias=None) -> torch.Tensor:
        """x against a Q8_0 / Q4_0 / Q4_1 block weight (the file's blocks or pack_gguf_weight's
        layout)."""
        raise NotImplementedError

    @op
    def gguf_embedding(self, ids, weight, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` of a block weight, dequantized to dtype."""
        raise NotImplementedError

    @op
    def pack_gguf_weight(self, weight, ggml_type: int):
        """A block weight laid out for this table's gguf_linear, or None to run on the file's
        blocks."""
        raise NotImplementedError

    # ---- LoRA (ops/reference/lora.py) ----

    @op
    def add_lora(self, x, y, lora_a, lora_b, groups, packed=None) -> torch.Tensor:
        """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for each token t of slot s in groups, in
        place."""
        raise NotImplementedError

    @op
    def pack_lora(self, lora_a, lora_b, sub_outputs: list[tuple[int, int]]):
        """This table's own layout of a layer's LoRA slots, passed back to add_lora as `packed`; or
        None."""
        raise NotImplementedError

    @op
    def repack_lora(self, packed, slot: int, lora_a, lora_b) -> None:
        """Copy `slot` of the plain slots into `packed` (pack_lora's) after an adapter was installed
        there."""
        raise NotImplementedError

    # ---- structured outputs (ops/reference/bitmask.py) ----

    @op
    def apply_token_bitmask(self, logits, rows: list[int], bitmask) -> None:
        """Set the logits of tokens a grammar forbids to -inf, in place, for the listed rows."""
        raise NotImplementedError

    # ---- the questions an engine asks its table (QUESTIONS) ----

    def describe(self) -> str:
        """What runs, for the start-up log line."""
        return self.name

    @classmethod
    def default_block_size(cls, device_type: str) -> int:
        """KV tokens per block when the user gives none (kvcache_block_size=None), asked before the
        table is built: the one rule per backend (ops.select.default_block_size)."""
        return DEFAULT_BLOCK_SIZE

    def check_block_size(self, block_size: int, multi_token: bool, decode_align: int = 16) -> None:
        """Raise ValueError naming the limit where this table's attention cannot run `block_size`
        (multi_token: the step has a query longer than one token; decode_align: the alignment its
        decode pages need)."""

    def decode_reads_only_used_blocks(self, block_size: int, dtype: torch.dtype) -> bool:
        """Whether decode attention reads only each sequence's own blocks, not the block table's
        whole width (which bounds the block-table width a captured graph may have)."""
        return False

    def recurrent_state_pool(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A zeroed recurrent-state pool of the reference's logical shape [..., Hv, Dk, Dv], laid
        out in memory as this table's delta-rule kernels read it (a view where that order differs:
        the reference, slot copies and checkpoints read it by its logical shape)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def graph_capture(self, device: torch.device):
        """How this table's decode steps are captured as graphs on `device`: an object with
        capture(fn) -> replayable (with host_lengths: capture(fn, lens), replay(lens)) and
        reads_only_used_blocks(block_size, dtype); None where the device has no graph mode. Raises
        GraphModeUnavailable where it has one that these ops cannot run (here: reading sequence
        lengths on the host)."""
        if device.type in GRAPH_DEVICES:
            raise GraphModeUnavailable(f"the {self.name} ops read sequence lengths on the host")
        return None

    def state_graph_refusal(self, state_dtype: torch.dtype) -> str | None:
        """Why a hybrid model's decode step on this table's linear-attention ops (causal_conv1d,
        gated_delta_rule) with a recurrent state of state_dtype cannot be captured in a graph;
        None where it can (the slots, has_state and cu_seqlens read on the device, a slot < 0
        writing nothing: engine/graph_runner.py pads with it)."""
        return f"the {self.name} linear-attention ops read lengths and slots on the host"

    def __deepcopy__(self, memo):
        # A model copied deep (e.g. to cast a copy to another dtype) still runs on its engine's op
        # table: loaded kernels are not data to duplicate.
        return self


OPS = tuple(name for name, member in vars(Backend).items() if getattr(member, "is_op", False))
QUESTIONS = tuple(name for name in vars(Backend) if not name.startswith("_") and name not in OPS)


class PerStep:
    """A one-entry cache for values an op derives from one step's metadata tensors (host length
    lists, merged rotary tables), rebuilt only when different tensor objects come in. Each op table
    holds its own.

    Every layer of a step passes the same ForwardContext tensors, and the model runner builds new
    ones for each step and never modifies them in place, so identity is the key (inference tensors
    have no version counter to check). Holding the tensors keeps their ids from being reused."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._key, self._value = (), None

    def get(self, build, *tensors):
        if len(tensors) != len(self._key) or any(a is not b for a, b in zip(tensors, self._key)):
            self._value = build(*tensors)
            self._key = tensors
        return self._value
