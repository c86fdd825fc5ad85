"""LoRARequest: the adapter a request runs with, shaped like vLLM's (vllm.lora.request.LoRARequest).
"""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (the server's `model` field); lora_int_id: a positive id, one
    per adapter (the engine's key for its slot and its prefix-cache blocks); lora_path: a PEFT
    folder (adapter_config.json + adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id,
                      bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest.lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a path, got {self.lora_path!r}")

    @classmethod
    def from_path(cls, path: str, lora_int_id: int = 1) -> "LoRARequest":
        """The one adapter of a Pipeline(lora=PATH) or of `vlinfer generate|chat|caption --lora
        PATH`: named after its folder."""
        path = os.fspath(path)
        return cls(os.path.basename(os.path.normpath(path)) or path, lora_int_id, path)
