"""Method "mtp": proposals from the target checkpoint's own multi-token prediction head (Qwen3.5,
Qwen3-Next `mtp.*`), run by the target's model runner (engine/mtp_head.py). What is refused, by
name, before any weight is read."""
from vlinfer.models.interfaces import HasMTPHead, HasStateSlots

MTP_PREFIX = "mtp."


def check_mtp_target(model_cls, tensors: dict, name: str) -> None:
    """A target that can run method "mtp": a model family with an MTP head (a hybrid one: its kept
    hidden state lives in the state slots) whose checkpoint holds the head's tensors."""
    if not (issubclass(model_cls, HasMTPHead) and issubclass(model_cls, HasStateSlots)):
        raise ValueError(
            f"speculative_config: method='mtp' runs the MTP heads of Qwen3.5 / Qwen3-Next "
            f"checkpoints; {name} ({model_cls.__name__}) has none: use 'ngram' or a draft model")
    if not any(t.startswith(MTP_PREFIX) for t in tensors):
        raise ValueError(
            f"speculative_config: method='mtp' needs the checkpoint's MTP head weights (mtp.*), "
            f"and {name} has none (a checkpoint saved by transformers drops them)")
