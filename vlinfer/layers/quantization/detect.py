"""Which quantization a checkpoint carries, decided from its files before the model is built:
config.json's `quantization_config.quant_method` (compressed-tensors, fp8), or what the user asked
for on load (`quantization="int8"|"int4"`). Unknown methods are refused here, naming what the
checkpoint says."""
import logging

from vlinfer.layers.quantization.base import CheckpointQuantization, TensorIndex
from vlinfer.layers.quantization.gguf import detect_gguf
from vlinfer.layers.quantization.modelslim import detect_modelslim

logger = logging.getLogger("vlinfer")
# LLM(model, quantization=...): a dense checkpoint quantized while loading
QUANTIZE_ON_LOAD = ("int8", "int4")
# quant_method prefixes of AutoGPTQ / GPTQModel / AutoAWQ checkpoints (gptq, gptq_marlin, awq, ...)
UNREAD_INT4_FORMATS = ("gptq", "awq")


def quantization_config(hf_config) -> dict | None:
    """config.json's quantization_config (the text config's for a multimodal model) as a dict, or
    None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
        config = getattr(text, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return config


def _from_quantization_config(hf_config, folder: str | None, tensors: TensorIndex):
    config = quantization_config(hf_config)
    if config is None:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        from vlinfer.layers.quantization.compressed_tensors import CompressedTensorsQuantization
        return CompressedTensorsQuantization(config)
    if method == "fp8":
        from vlinfer.layers.quantization.fp8 import Fp8Quantization
        return Fp8Quantization(config)
    if str(method).lower().startswith(UNREAD_INT4_FORMATS):
        raise ValueError(
            f"quantization_config.quant_method={method!r}: GPTQ / AWQ checkpoints are not read by "
            "vlinfer (it has no GPTQ or AWQ loader, for any model); open the model's "
            "compressed-tensors W4A16 release (what llm-compressor writes), or its dense "
            "checkpoint with quantization='int4'")
    raise ValueError(
        f"quantization_config.quant_method={method!r} is not supported; vlinfer loads "
        "'compressed-tensors' (int8 W8A8, W8A16, W4A16) and 'fp8' (block-quantized, dequantized on "
        "load)")


# Checked in order; the first that recognizes the checkpoint decides. Each: (hf_config, folder,
# tensors) -> CheckpointQuantization | None. msModelSlim first: its description file decides,
# whatever config.json says. GGUF: its tensor index names ggml block types (only GGUF indexes do).
DETECTORS = (detect_modelslim, _from_quantization_config, detect_gguf)


def detect_quantization(hf_config, folder: str | None, tensors: TensorIndex,
                        requested: str | None = None) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or the on-load one asked for; None: dense."""
    if requested is not None and requested not in QUANTIZE_ON_LOAD:
        raise ValueError(
            f"quantization={requested!r}: expected None (keep what the checkpoint has) or one of "
            f"{', '.join(map(repr, QUANTIZE_ON_LOAD))}")
    found = None
    for detector in DETECTORS:
        found = detector(hf_config, folder, tensors)
        if found is not None:
            break
    if requested is not None:
        # A GGUF file's blocks can be dequantized on load like its other tensors, then quantized as
        # asked.
        if found is not None and found.name != "gguf":
            raise ValueError(
                f"quantization={requested!r} quantizes a dense checkpoint on load, but this "
                "checkpoint "
                f"is already quantized ({found.describe()}); pass quantization=None")
        from vlinfer.layers.quantization.on_load import OnLoadQuantization
        return OnLoadQuantization(requested)
    if found is not None:
        logger.info("checkpoint quantization: %s", found.describe())
    return found
