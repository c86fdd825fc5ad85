"""Scheduling and memory (pure Python), plus the model runner that turns a schedule into tensors."""
from vlinfer.engine.block_manager import BlockManager, hash_block
from vlinfer.engine.engine_loop import EngineLoop, RequestStream
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.engine.model_runner import ModelRunner
from vlinfer.engine.scheduler import Scheduler, SchedulerOutput
from vlinfer.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManager", "EngineLoop", "RequestStream", "LLMEngine", "ModelRunner", "Scheduler",
    "SchedulerOutput", "Sequence", "SequenceStatus", "hash_block"
]
