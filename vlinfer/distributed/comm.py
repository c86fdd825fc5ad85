"""How the ranks of one tensor-parallel engine find each other and talk.

- Rendezvous: a TCPStore. Spawned workers (the default) meet on a store rank 0 hosts on 127.0.0.1 at
  a port the
  OS picks, so two engines on one host never collide; an explicit `distributed_init_method`
  ("tcp://host:port",
  "env://") or torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) names it instead.
- Two process groups per engine, built from the store and registered nowhere global (see
  vlinfer/layers/distributed.py): a gloo "control" group on CPU that carries rank 0's messages, and
  the "device"
  group (gloo / nccl / hccl) the layers' all-reduce and all-gather run on. Two, because their
  timeouts differ:
  a worker waits for the next control message as long as the engine sits idle, while a step's
  collectives
  time out short (distributed_timeout_s), so a rank that hangs mid-step becomes an error, not a
  hang.
- The control channel (ControlChannel): rank 0 broadcasts one message per step (the step's prepared
  CPU tensors
  and metadata, image rows included) or per command. Nothing goes through shared memory, so nothing
  is left
  in /dev/shm.
"""
import io
import math
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from vlinfer import platform
from vlinfer.layers.distributed import TPGroup, new_backend

STORE_PREFIX = "vlinfer"
# a worker waits for rank 0's next message as long as the engine lives
IDLE_TIMEOUT = timedelta(days=3650)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, raised, or stopped answering; the engine cannot continue."""


@dataclass
class ParallelConfig:
    """The tensor-parallel options of an engine (EngineConfig's tensor_parallel_size and
    distributed_* fields, validated there), plus what the launch environment says about this
    process's rank."""
    tensor_parallel_size: int
    distributed_init_method: str | None
    distributed_timeout_s: float
    distributed_startup_timeout_s: float

    @classmethod
    def of(cls, config) -> "ParallelConfig":
        return cls(config.tensor_parallel_size, config.distributed_init_method,
                   config.distributed_timeout_s, config.distributed_startup_timeout_s)

    @property
    def launched_externally(self) -> bool:
        """True when every rank was started by a launcher (torchrun, or by hand with RANK /
        WORLD_SIZE set): rank 0 runs the engine and the others run the worker loop; nothing is
        spawned."""
        return self.tensor_parallel_size > 1 and "RANK" in os.environ and "WORLD_SIZE" in os.environ

    @property
    def rank(self) -> int:
        return int(os.environ["RANK"]) if self.launched_externally else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank)) if self.launched_externally else 0

    def init_method(self) -> str:
        return self.distributed_init_method or ("env://" if self.launched_externally else
                                                "tcp://127.0.0.1:0")

    def check_world(self) -> None:
        if self.launched_externally and int(os.environ["WORLD_SIZE"]) != self.tensor_parallel_size:
            raise ValueError(
                f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size="
                f"{self.tensor_parallel_size}; vlinfer runs one engine over all launched ranks")


def host_store(url: str, timeout: timedelta) -> tuple[dist.Store, str]:
    """Rank 0 of spawned workers: host the store without waiting for anyone (the workers start after
    it). Returns it and the URL the workers connect to (port 0 resolved to the port the OS picked).
    """
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or parsed.port is None:
        raise ValueError(
            f"distributed_init_method for spawned workers must be tcp://host:port, got {url!r}")
    store = dist.TCPStore(parsed.hostname, parsed.port, None, True, timeout, wait_for_workers=False)
    return store, f"tcp://{parsed.hostname}:{store.port}"


def connect_store(url: str, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """Any rank of externally launched ranks (rank 0 hosts the store unless torchrun's agent does),
    and the spawned workers (clients of rank 0's store)."""
    if url.startswith("env://"):
        store, _, _ = next(dist.rendezvous(url, timeout=timeout))
    else:
        store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world, timeout=timeout))
    return store


class ControlChannel:
    """Rank 0 -> every rank: one message per broadcast; and every rank -> rank 0 for reports.

    A message is pickled with its tensors taken out: pickling a tensor is slow (measured here: ~100
    ms to pickle and ~190 ms to unpickle 18 MiB of image rows, against ~18 ms to broadcast the raw
    bytes). The pickle and the small tensors travel in one fixed-size head broadcast, which is all a
    step needs up to large batches: each collective is a round trip that costs more than its bytes
    (~0.05 ms on an idle loopback, ~0.8 ms measured on a busy 2-core VM). Larger tensors (image
    rows, big block tables) follow as one raw broadcast each, straight from and into their own
    memory."""

    HEAD = 64 * 1024
    INLINE = 4096  # tensors up to this many bytes ride in the head when there is room

    def __init__(self, backend, rank: int, size: int):
        self.backend, self.rank, self.size = backend, rank, size

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.backend.broadcast([tensor], options).wait()

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).view(torch.uint8)

    def broadcast(self, message=None):
        """Rank 0 passes the message; the others get it."""
        head = torch.zeros(self.HEAD, dtype=torch.uint8)
        if self.rank == 0:
            tensors = []

            class Pickler(pickle.Pickler):
                def persistent_id(self, obj):
                    if isinstance(obj, torch.Tensor):
                        tensors.append(obj.detach().cpu().contiguous())
                        return len(tensors) - 1
                    return None

            buffer = io.BytesIO()
            Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
            specs = [[t.dtype, tuple(t.shape), False] for t in tensors]
            blob = pickle.dumps((buffer.getvalue(), specs))  # True / False pickle to the same size
            offset = 16 + len(blob)
            if offset <= self.HEAD:
                for spec, t in zip(specs, tensors):
                    start = offset + -offset % 16  # aligned, so the receiver views it in place
                    nbytes = t.numel() * t.element_size()
                    if nbytes <= self.INLINE and start + nbytes <= self.HEAD:
                        head[start:start + nbytes] = self._bytes(t)
                        spec[2], offset = True, start + nbytes
                blob = pickle.dumps((buffer.getvalue(), specs))
            head[:16] = torch.tensor([len(blob), 0], dtype=torch.int64).view(torch.uint8)
            blob = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if 16 + len(blob) <= self.HEAD:
                head[16:16 + len(blob)] = blob
                self._broadcast(head)
            else:  # a huge pickle: the head carries only its length
                self._broadcast(head)
                self._broadcast(blob)
            for (_, _, inline), t in zip(specs, tensors):
                if not inline and t.numel():
                    self._broadcast(self._bytes(t))
            return message
        self._broadcast(head)
        blob_len = int(head[:8].view(torch.int64))
        if 16 + blob_len <= self.HEAD:
            blob = head[16:16 + blob_len]
        else:
            blob = torch.empty(blob_len, dtype=torch.uint8)
            self._broadcast(blob)
        meta, specs = pickle.loads(blob.numpy().tobytes())
        offset, tensors = 16 + blob_len, []
        for dtype, shape, inline in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if inline:
                offset += -offset % 16
                tensors.append(head[offset:offset + nbytes].view(dtype).view(shape))
                offset += nbytes
            else:
                data = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    self._broadcast(data)
                tensors.append(data.view(dtype).view(shape))

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid):
                return tensors[pid]

        return Unpickler(io.BytesIO(meta)).load()

    def gather(self, obj) -> list | None:
        """Every rank's obj, in rank order, on rank 0 (None elsewhere)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.backend.allgather([lengths], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.backend.allgather([parts], [padded]).wait()
        if self.rank != 0:
            return None
        return [pickle.loads(p[:int(n)].numpy().tobytes()) for p, n in zip(parts, lengths)]


def control_channel(store: dist.Store, rank: int, world: int, timeout: timedelta,
                    join_timeout: timedelta | None = None) -> ControlChannel:
    backend = new_backend("gloo", dist.PrefixStore(f"{STORE_PREFIX}/control", store), rank, world,
                          timeout, join_timeout)
    return ControlChannel(backend, rank, world)


def device_group(store: dist.Store, rank: int, world: int, device: torch.device, timeout: timedelta,
                 join_timeout: timedelta | None = None) -> TPGroup:
    name = platform.distributed_backend(device)
    backend = new_backend(name, dist.PrefixStore(f"{STORE_PREFIX}/device", store), rank, world,
                          timeout, join_timeout)
    return TPGroup(rank, world, backend)


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """Rank r of a node uses accelerator r of that node (all of them share the CPU)."""
    if device_type == "cpu":
        return torch.device("cpu")
    device = torch.device(device_type, local_rank)
    getattr(torch, device_type).set_device(device)
    return device
