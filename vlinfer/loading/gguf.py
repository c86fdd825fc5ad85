"""The tensors of a GGUF file under their Hugging Face names, the way transformers' GGUF loader
names and prepares them (its tensor-name map and its per-architecture TensorProcessor, e.g. Llama's
reverse permutation of the q / k rows), with one difference: Q8_0, Q4_0 and Q4_1 weights can be kept
in their GGUF blocks (uint8 [N, K / 32 * block_bytes], one row of blocks per output feature) instead
of being dequantized to float32.

A tensor is kept quantized only where that is exact: a 2-D weight of one of those types whose
processor does nothing to it but reorder whole rows (Llama's q / k permutation works on rows, so it
applies to block rows as it does to float rows). Every other tensor is dequantized by gguf-py, as
transformers does, and the load log says how many and of which types. `tensor_index` and `iterate`
apply the same rule, so the index the quantization layer chooses methods from describes exactly what
the loader then yields."""
import collections
import functools
from contextlib import contextmanager
import logging

import numpy as np
import torch

from vlinfer.layers.quantization.base import TensorInfo
from vlinfer.loading import gguf_qwen35
from vlinfer.ops.reference.gguf import GGUF_BLOCK_TYPES

logger = logging.getLogger("vlinfer")
KEPT_TYPE_NAMES = {name for name, _ in GGUF_BLOCK_TYPES.values()}


@contextmanager
def _cached_gguf_name_maps():
    """transformers rebuilds gguf's tensor-name map once per model parameter (about 400 times for
    SmolLM2, half of the load time); the map depends only on (architecture, layer count), so serve
    it from a cache while loading."""
    import gguf
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _array_reader(path: str):
    """gguf-py's GGUFReader over the file's bytes as a plain ndarray: it slices its np.memmap once
    per header field and array element (every token of the vocabulary), and np.memmap's Python-level
    slicing made that 3x slower."""
    from gguf import GGUFReader

    class ArrayReader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):  # GGUFReader.__init__ assigns its np.memmap here
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return ArrayReader(path)


def architecture(reader) -> str:
    """The file's general.architecture ("llama", "qwen35", ...)."""
    return gguf_qwen35.header_value(reader, "general.architecture")


def read_config(path: str):
    """The config of a GGUF file whose architecture transformers' GGUF loader does not read
    (qwen35, qwen35moe), or None: transformers reads it. The architecture is peeked from the
    header's key-value pairs, so other files' headers (a vocabulary takes seconds) are parsed no
    more often than before."""
    name = gguf_qwen35.peek_architecture(path)
    if name not in gguf_qwen35.ARCHITECTURES:
        return None
    return gguf_qwen35.read_config(_array_reader(path))


def _reader_and_mapping(path: str, config):
    """(reader, processor, {gguf name: hf name}) for a GGUF file, built as transformers builds them.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)
    reader = _array_reader(path)
    name = architecture(reader)
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    # before transformers builds that many layers to name them
    if config.num_hidden_layers > len(blocks):
        raise ValueError(
            f"its header declares {config.num_hidden_layers} blocks, it has tensors for "
            f"{len(blocks)}"
        )
    if name in gguf_qwen35.ARCHITECTURES:  # transformers' GGUF loader does not read it
        mapping = gguf_qwen35.hf_names(config)
        return reader, gguf_qwen35.Qwen35TensorProcessor(config, mapping), mapping, {"tensors": {}}
    # The processor reads the config transformers parsed from this file's header (head counts for
    # Llama's q / k permutation): `config` is that parse.
    parsed = {"config": config.to_dict()}
    processor = TENSOR_PROCESSORS.get(name, TensorProcessor)(config=parsed["config"])
    # transformers maps GGUF names through an (empty) model of the same config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    # some processors (MoE experts) store what they assemble here, as in transformers
    parsed["tensors"] = {}
    return reader, processor, mapping, parsed


def _keeps_blocks(tensor, processor) -> bool:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor
    if isinstance(processor, gguf_qwen35.Qwen35TensorProcessor):
        return (tensor.tensor_type.name in KEPT_TYPE_NAMES and tensor.data.ndim == 2 and
                processor.keeps_blocks(tensor.name))
    return (tensor.tensor_type.name in KEPT_TYPE_NAMES and tensor.data.ndim == 2 and
            type(processor) in (TensorProcessor, LlamaTensorProcessor))


def tensor_index(path: str, config) -> dict[str, TensorInfo]:
    """{hf name: TensorInfo} of what `iterate(keep_blocks=True)` yields, from the file's header:
    shape (N, K) in the Hugging Face orientation and dtype "Q8_0" / "Q4_0" / "Q4_1" for tensors kept
    in blocks, "F32" otherwise."""
    with _cached_gguf_name_maps():
        reader, processor, mapping, _ = _reader_and_mapping(path, config)
    index = {}
    for tensor in reader.tensors:
        name = mapping.get(tensor.name)
        if name is None:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists ne[0] (K) first
        if isinstance(processor, gguf_qwen35.Qwen35TensorProcessor):
            shape = processor.index_shape(tensor.name, shape)
        dtype = tensor.tensor_type.name if _keeps_blocks(tensor, processor) else "F32"
        index[name] = TensorInfo(shape, dtype)
    return index


def iterate(path: str, config, keep_blocks: bool):
    """(hf name, tensor) for every tensor transformers would load: float32 as transformers
    dequantizes it, or with keep_blocks the Q8_0 / Q4_0 / Q4_1 weights as uint8 block rows (see the
    module doc)."""
    from gguf import dequantize
    with _cached_gguf_name_maps():
        reader, processor, mapping, parsed = _reader_and_mapping(path, config)
    dequantized = collections.Counter()
    for tensor in reader.tensors:
        blocks = keep_blocks and _keeps_blocks(tensor, processor)
        weights = np.asarray(tensor.data) if blocks else dequantize(tensor.data, tensor.tensor_type)
        if not blocks and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            dequantized[tensor.tensor_type.name] += 1
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                   parsed_parameters=parsed)
        if result.name in mapping:
            yield mapping[result.name], torch.from_numpy(np.copy(result.weights))
    for name in list(parsed["tensors"]):
        yield name, parsed["tensors"].pop(name)
    if dequantized:
        what = ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items()))
        if keep_blocks:
            logger.info(
                "GGUF: %s tensors dequantized to float32 on load (vlinfer keeps %s in their "
                "blocks; these "
                "have no kernel here)", what, "/".join(sorted(KEPT_TYPE_NAMES)))
        else:
            logger.info("GGUF: %s tensors dequantized to float32 on load", what)
