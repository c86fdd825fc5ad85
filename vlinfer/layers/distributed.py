"""Tensor-parallel rank, size and collectives, as one small TPGroup object per engine.

A layer gets its engine's group with the rest of its ModelContext when it is built and runs its
collectives on that group, so two engines in one process never share one: each has its own process
group. That rules out torch.distributed's global default group (one per process), so an engine's
groups are built directly from a backend class and a store ("stateless" groups, as vLLM builds its
extra groups). SINGLE: the model runs whole on one device."""
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(eq=False, frozen=True)
class TPGroup:
    rank: int
    size: int
    # a c10d Backend / ProcessGroup on the model's device; None when size == 1
    backend: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dim in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, -1)


SINGLE = TPGroup(0, 1)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def new_backend(name: str, store, rank: int, size: int, timeout: timedelta,
                join_timeout: timedelta | None = None):
    """A process group backend of this engine only, not registered with torch.distributed's global
    state. timeout bounds each collective; join_timeout (default: the same) the meeting of the ranks
    when the group is made: gloo meets at construction, where a peer may still be starting
    (unpickling its init, importing), so a short step timeout there failed start-up on a busy
    machine."""
    if name == "gloo":
        backend = dist.ProcessGroupGloo(store, rank, size, join_timeout or timeout)
        backend.set_timeout(timeout)
        return backend
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
    elif name == "hccl":
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        backend = ProcessGroupHCCL(store, rank, size, options)
    else:
        raise ValueError(f"unknown distributed backend {name!r}")
    # NCCL / HCCL agree on a communicator id through it
    if hasattr(backend, "_set_sequence_number_for_group"):
        backend._set_sequence_number_for_group()
    return backend
