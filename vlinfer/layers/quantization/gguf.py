"""GGUF Q8_0 / Q4_0 / Q4_1 weights kept in their blocks (no dequantization on load).

The checkpoint index (loading.checkpoint_tensor_index -> loading.gguf.tensor_index) marks each
weight the loader will hand over as blocks with its ggml type name; every linear layer whose weight
is one of those gets a GgufLinearMethod, the rest stay dense (float32 weights gguf-py dequantized,
as transformers loads them; other GGUF types such as Q6_K are dequantized that way and the loader
logs it). The token embedding (and the LM head tied to it) keeps its blocks too when the file has
them quantized (assign_gguf_embeddings).

A layer holds `weight`: uint8 [N, K / 32 * block_bytes], the file's block rows for its output
features (fused q/k/v and gate/up shards stacked by rows, like dense weights). Blocks run along K,
so a row-parallel rank's columns are a whole number of blocks when its K is a multiple of 32
(refused otherwise, naming the layer). The matmul is the op table's `gguf_linear`
(ops/reference/gguf.py defines it; the CPU kernel is vlinfer/ops/cpu/csrc/gguf_blocks.cpp)."""
import logging

import torch
from torch import nn

from vlinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlinfer.layers.quantization.base import (CheckpointQuantization, LinearMethod, ParamLayout,
                                              ParamSpec, TensorIndex)
from vlinfer.ops.reference.gguf import BLOCK, GGUF_BLOCK_TYPES, block_bytes

logger = logging.getLogger("vlinfer")
GGML_TYPE_IDS = {name: type_id for type_id, (name, _) in GGUF_BLOCK_TYPES.items()}


def _block_layout(ggml_type: int) -> ParamLayout:
    size = block_bytes(ggml_type)
    return ParamLayout(lambda n, k: (n, k // BLOCK * size), output_dim=0, input_dim=1)


class GgufLinearMethod(LinearMethod):
    def __init__(self, ggml_type: int, prefix: str):
        self.ggml_type = ggml_type
        self.type_name = GGUF_BLOCK_TYPES[ggml_type][0]
        self.name = f"gguf-{self.type_name.lower()}"
        self.prefix = prefix

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        for what, features in (("input", layer.input_size), ("full input", layer.full_input_size)):
            if features % BLOCK:
                raise ValueError(
                    f"layer {self.prefix}: {self.type_name} blocks hold {BLOCK} input features "
                    "each, "
                    f"but this rank's {what} size is {features}")
        shape = (layer.output_size, layer.input_size // BLOCK * block_bytes(self.ggml_type))
        return {"weight": ParamSpec(shape, torch.uint8, _block_layout(self.ggml_type))}

    def process_weights_after_loading(self, layer) -> bool:
        packed = layer.ops.pack_gguf_weight(layer.weight.data, self.ggml_type)
        if packed is None:
            return False
        layer.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.ops.gguf_linear(x, layer.weight, self.ggml_type, bias)


class GgufQuantization(CheckpointQuantization):
    """A GGUF file's Q8_0 / Q4_0 / Q4_1 weights, layer by layer from the tensor index."""
    name = "gguf"

    def __init__(self, tensors: TensorIndex):
        self.types = sorted(
            {info.dtype
             for info in tensors.values() if info.dtype in GGML_TYPE_IDS})

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        info = tensors.get(prefix + ".weight")
        if info is None or info.dtype not in GGML_TYPE_IDS:
            return None
        return GgufLinearMethod(GGML_TYPE_IDS[info.dtype], prefix)

    def describe(self) -> str:
        return f"GGUF {'/'.join(self.types)} kept in blocks"


def detect_gguf(hf_config, folder, tensors: TensorIndex) -> GgufQuantization | None:
    """A GGUF file's index marks block weights with their ggml type names (only GGUF indexes do)."""
    if any(info.dtype in GGML_TYPE_IDS for info in tensors.values()):
        return GgufQuantization(tensors)
    return None


def assign_gguf_embeddings(model: nn.Module, tensors: TensorIndex) -> int:
    """Give every token embedding whose checkpoint table is in blocks a uint8 block parameter (rows
    = vocabulary, sharded by rows as before), and re-tie an LM head that shares it; an untied LM
    head in blocks gets its own. Returns how many tables keep their blocks. Module names are the
    checkpoint's (the Llama-family layout)."""
    kept = 0
    # id of the old float parameter -> (it, the new block parameter), for tied heads. The old
    # parameter is kept in the entry: freed, its id could be reused by a later new parameter (an
    # untied head's) and read as a tie.
    replaced = {}
    modules = list(model.named_modules())
    for name, module in modules:
        if not isinstance(module, VocabParallelEmbedding):
            continue
        if isinstance(module, ParallelLMHead) and id(module.weight) in replaced:
            continue  # tied: handled below
        checkpoint_name = name + ".weight"
        info = tensors.get(checkpoint_name)
        if info is None or info.dtype not in GGML_TYPE_IDS:
            continue
        ggml_type = GGML_TYPE_IDS[info.dtype]
        old = module.weight
        rows, dim = old.shape
        if dim % BLOCK:
            raise ValueError(
                f"{checkpoint_name}: {info.dtype} blocks hold {BLOCK} features each, the embedding "
                f"width is {dim}")
        param = nn.Parameter(
            torch.empty(rows, dim // BLOCK * block_bytes(ggml_type), dtype=torch.uint8,
                        device=old.device), requires_grad=False)
        param.weight_loader = module.weight_loader
        module.weight = param
        module.gguf_type = ggml_type
        module.embedding_dtype = old.dtype
        replaced[id(old)] = (old, param)
        kept += 1
    for name, module in modules:
        if isinstance(module, ParallelLMHead) and id(module.weight) in replaced:
            param = replaced[id(module.weight)][1]
            source = next(m for _, m in modules
                          if isinstance(m, VocabParallelEmbedding) and m.weight is param)
            module.gguf_type, module.embedding_dtype = source.gguf_type, source.embedding_dtype
            module.weight = param
    if kept:
        logger.info(
            "GGUF: %d embedding table(s) kept in blocks (lookups dequantize their rows; a tied LM "
            "head runs "
            "gguf_linear on them)", kept)
    return kept
