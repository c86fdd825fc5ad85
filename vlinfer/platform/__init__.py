"""What the machine is and what it can do: the device and its memory (device.py), the CPU's
instruction sets (cpu_features.py), the process's thread count (threads.py). Nothing else in vlinfer
branches on the device type."""
from vlinfer.platform.device import (available_memory, distributed_backend, holds_dtype,
                                     npu_available, peak_memory, resolve_device, resolve_dtype,
                                     total_memory)
from vlinfer.platform.threads import cores_per_rank, set_process_threads

__all__ = ["available_memory", "cores_per_rank", "distributed_backend", "holds_dtype",
           "npu_available", "peak_memory", "resolve_device", "resolve_dtype", "set_process_threads",
           "total_memory"]
