"""Weight quantization of the linear layers: the per-layer method interface (base.py), the
checkpoint formats that choose a method per layer (compressed_tensors.py, fp8.py, on_load.py),
detection (detect.py) and assignment (assign.py)."""
from vlinfer.layers.quantization.assign import assign_methods
from vlinfer.layers.quantization.base import (CheckpointQuantization, LinearMethod, ParamLayout,
                                              ParamSpec, TensorIndex, TensorInfo)
from vlinfer.layers.quantization.detect import QUANTIZE_ON_LOAD, detect_quantization

__all__ = [
    "CheckpointQuantization", "LinearMethod", "ParamLayout", "ParamSpec", "TensorIndex",
    "TensorInfo", "assign_methods", "detect_quantization", "QUANTIZE_ON_LOAD"
]
