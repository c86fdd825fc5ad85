"""FP8 checkpoints (`quant_method: "fp8"`, e4m3 weights with one `weight_scale_inv` per 128 x 128
block, as Qwen's official FP8 repos): dequantized to the compute dtype while loading, W = W8 *
scale_inv per block, and run dense. They open and match their dequantized weights; they are not
faster (logged). Layers in `modules_to_not_convert` / `ignored_layers`, and any whose weight is not
FP8 in the file, are dense as stored; an FP8 weight for a listed module is refused. A fused layer
may mix the two (Qwen3.5's Gated DeltaNet in_proj: in_proj_qkv / in_proj_z FP8, in_proj_b /
in_proj_a listed dense): the e4m3 values load into the compute dtype (exact: e4m3's 3 mantissa
bits and exponent range fit bf16, fp16 and float32), a dense shard's rows keep a scale of 1."""
import logging

import torch
from torch import nn

from vlinfer.layers.quantization.base import (CheckpointQuantization, LinearMethod, ParamLayout,
                                              ParamSpec, TensorIndex, dense_weight_layout)

logger = logging.getLogger("vlinfer")


def _expand_rows(block_rows: int):
    """[ceil(N / b), Kb] block scales -> [N, Kb]: one row per output feature, so shards and ranks
    cut it by rows."""
    def convert(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return scale.float().repeat_interleave(block_rows, 0)[:rows]
    return convert


class Fp8BlockMethod(LinearMethod):
    name = "fp8"
    hosts_dense_shards = True

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def signature(self) -> tuple:
        return (self.name, self.block)

    def describe(self) -> str:
        return f"fp8 e4m3 block {self.block[0]}x{self.block[1]} (dequantized on load)"

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        bn, bk = self.block
        n, k = layer.output_size, layer.input_size
        # e4m3 values held in the compute dtype (exact), so dense shards load beside them
        specs = {"weight": ParamSpec((n, k), layer.params_dtype, dense_weight_layout())}
        # A shard's scale rows are expanded whole before cutting (a fused shard may not start on a
        # block).
        layout = ParamLayout(lambda rows, cols: (-(-rows // bn), -(-cols // bk)),
                             convert=_expand_rows(bn), convert_first=True)
        # row-parallel ranks hold whole blocks
        blocks = -(-k // bk) if layer.full_input_size == k else k // bk
        # 1 where no scale is loaded: the rows of a shard the checkpoint keeps dense
        specs["weight_scale_inv"] = ParamSpec((n, blocks), torch.float32, layout, fill=1.0)
        return specs

    def dequantized_weight(self, layer) -> torch.Tensor:
        bk = self.block[1]
        k = layer.input_size
        scale = layer.weight_scale_inv.data.repeat_interleave(bk, 1)[:, :k]
        weight = layer.weight.data.float() * scale
        del layer.weight, layer.weight_scale_inv
        return weight

    def process_weights_after_loading(self, layer) -> bool:
        weight = self.dequantized_weight(layer).to(layer.params_dtype)
        layer.method = None  # from here on an ordinary dense layer, packed like one
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.pack_weight()
        return False

    def apply(self, layer, x, bias):
        raise RuntimeError("fp8 layers are dequantized after loading and run dense")


class Fp8Quantization(CheckpointQuantization):
    name = "fp8"

    def __init__(self, config: dict):
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config (fp8): fmt={fmt!r} is not supported (e4m3)")
        block = config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and
                all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(
                f"quantization_config (fp8): weight_block_size={block!r} is not supported; "
                "expected "
                "[rows, cols] blocks such as [128, 128]")
        self.block = tuple(block)
        self.skip = list(config.get("modules_to_not_convert") or []) + list(
            config.get("ignored_layers") or [])
        logger.warning(
            "fp8 checkpoint: weights are dequantized to the compute dtype on load (they open, but "
            "run "
            "at dense speed and memory)")

    def describe(self) -> str:
        return f"fp8 block {self.block[0]}x{self.block[1]}, dequantized on load"

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        weight = tensors.get(f"{prefix}.weight")
        has_scale = f"{prefix}.weight_scale_inv" in tensors
        if weight is None or not weight.dtype.startswith("F8"):
            if has_scale:
                raise ValueError(
                    f"{prefix}.weight_scale_inv: present but {prefix}.weight is not FP8")
            return None
        if any(prefix == s or prefix.startswith(s + ".") or prefix.endswith("." + s)
               for s in self.skip):
            raise ValueError(
                f"{prefix}.weight is FP8 but the layer is listed in modules_to_not_convert")
        if weight.dtype != "F8_E4M3":
            raise ValueError(f"{prefix}.weight: {weight.dtype} is not supported (F8_E4M3)")
        if not has_scale:
            raise ValueError(f"{prefix}: FP8 weight without {prefix}.weight_scale_inv")
        return Fp8BlockMethod(self.block)
