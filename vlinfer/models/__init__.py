from vlinfer.models.registry import get_model_class, pooling_task, supported_architectures

__all__ = ["get_model_class", "pooling_task", "supported_architectures"]
