from vlinfer.models.interfaces import Heads, SupportsMultiModal
from vlinfer.models.registry import get_model_class, pooling_task, supported_architectures

__all__ = ["Heads", "SupportsMultiModal", "get_model_class", "pooling_task",
           "supported_architectures"]
