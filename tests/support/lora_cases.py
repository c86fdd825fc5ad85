"""Builders and constants of tests/models/test_lora.py that other test modules use too (ALL_LINEARS,
make_adapter): imported from here by every one of them, that module included."""
import torch
from vlinfer import LoRARequest

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, folder: str, rank: int, alpha: int, rslora: bool, targets: list[str],
                 seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():  # O(1) updates: a comparison that could miss an adapter would fail
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(folder)
    peft_model.unload()
    return folder


def peft_model(path: str, adapter: LoRARequest | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model,
                                     adapter.lora_path).eval() if adapter is not None else model
