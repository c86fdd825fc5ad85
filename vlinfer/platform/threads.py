"""The process's CPU thread count. torch keeps one intra-op thread pool per process, so the count
belongs to whoever owns the process: its entry point (the CLI, a tensor-parallel worker, a Ray
actor) sets it here, and a library call (building an LLM inside a user's program) never changes it.
"""
import logging
import os

import torch

logger = logging.getLogger("vlinfer")


def cores_per_rank(world: int) -> int:
    """Threads for each of `world` processes sharing this host's cores."""
    return max(1, (os.cpu_count() or 1) // world)


def set_process_threads(num_threads: int) -> None:
    """Set torch's intra-op thread count for this process; called from process entry points only."""
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    if torch.get_num_threads() != num_threads:
        logger.info("this process runs %d CPU threads (was %d)", num_threads,
                    torch.get_num_threads())
        torch.set_num_threads(num_threads)
