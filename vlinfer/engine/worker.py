"""A tensor-parallel worker: ranks 1..N-1 of an engine. It builds its shard of the model and its
heads of the KV pool, then runs whatever rank 0 sends, until rank 0 says stop or goes away.

Started three ways, all ending in `serve`:
- spawned by rank 0 (`LLM(..., tensor_parallel_size=N)` on one host): `spawned_worker_main`;
- by a launcher that starts every rank (torchrun, one or many nodes) running the user's script:
  `LLM(...)` on a
  rank other than 0 calls `serve_from_env` and exits the process when the engine closes;
- by hand or by a launcher running this module on the other ranks: `python -m
  vlinfer.engine.worker`, with
  RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (or --rank / --world-size / --init-method).
The worker needs no model argument: rank 0 sends the resolved model path, configs and dtype. Each
node must see
the model files at that same path."""
import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch

from vlinfer.config import EngineConfig
from vlinfer.distributed.comm import (IDLE_TIMEOUT, ParallelConfig, connect_store, control_channel,
                                      device_group, rank_device)
from vlinfer.platform import cores_per_rank, set_process_threads

logger = logging.getLogger("vlinfer")

# Test hook: "RANK:STEP" makes that worker raise at its STEP-th step, "RANK:STEP:hang" makes it stop
# answering there, to test how the engine reports each.
FAULT_ENV = "VLINFER_TEST_WORKER_FAULT"


def serve(url: str, rank: int, world: int, local_rank: int, parallel: ParallelConfig) -> None:
    """Connect, build the shard, run rank 0's messages. A failure is written to the store for rank 0
    to report, then re-raised so the process exits non-zero."""
    startup = timedelta(seconds=parallel.distributed_startup_timeout_s)
    step_timeout = timedelta(seconds=parallel.distributed_timeout_s)
    store = connect_store(url, rank, world, startup)
    try:
        store.set(f"vlinfer/hello/{rank}", str(os.getpid()))
        channel = control_channel(store, rank, world, IDLE_TIMEOUT, startup)
        kind, init = channel.broadcast()
        if kind != "init":
            raise RuntimeError(
                f"tensor-parallel rank {rank}: expected the init message from rank 0, got {kind!r}")
        device = rank_device(init["device_type"], local_rank)
        group = device_group(store, rank, world, device, step_timeout, startup)
        runner = _build(init, device, group)
        store.set(f"vlinfer/ready/{rank}", "1")
        _loop(channel, runner, rank)
    except BaseException as e:
        if isinstance(e, RuntimeError) and "Connection closed by peer" in str(e):
            logger.warning("tensor-parallel worker rank %d: rank 0 went away; exiting", rank)
            raise SystemExit(1)
        try:
            store.set(f"vlinfer/error/{rank}", "".join(traceback.format_exception(e))[-4000:])
        except Exception:
            pass
        raise


def _build(init: dict, device: torch.device, group):
    from vlinfer.engine.build_runner import build_runner
    config = init["config"]
    return build_runner(config, init["source"], init["hf_config"], device, init["block_size"],
                        ops_choice=config.ops, dtype=init["dtype"],
                        kv_cache_dtype=init["kv_cache_dtype"], group=group,
                        expert_parallel=config.enable_expert_parallel,
                        quantization=config.quantization, pooling=init["pooling"])


def _loop(channel, runner, rank: int) -> None:
    fault = os.environ.get(FAULT_ENV, "").split(":")
    fault_step = int(fault[1]) if fault[0] == str(rank) else -1
    steps = 0
    while True:
        message = channel.broadcast()
        kind = message[0]
        if kind == "step":
            steps += 1
            if steps == fault_step:
                if fault[2:] == ["hang"]:
                    time.sleep(3600)
                raise RuntimeError(f"injected fault at step {steps} ({FAULT_ENV})")
            runner.forward(message[1])
        elif kind == "allocate_kv_cache":
            runner.allocate_kv_cache(*message[1:])
        elif kind == "install_lora":
            runner.install_lora(*message[1:])
        elif kind == "describe":
            channel.gather(runner.describe())
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown control message {kind!r}")


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker must not outlive rank 0, however rank 0 ends (SIGKILL included)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="vlinfer-parent-watch", daemon=True).start()


def _exit_now(code: int) -> None:
    """End a worker without the interpreter's teardown (seconds with a model loaded): its sockets
    close at once, which is how the other ranks learn it is gone, and it holds nothing else that
    needs closing."""
    # what a normal exit of a multiprocessing child runs: releases its semaphores (tqdm's lock, ...)
    try:
        import multiprocessing.util
        multiprocessing.util._exit_function()
    except Exception:
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve_then_exit(url: str, rank: int, world: int, local_rank: int,
                     parallel: ParallelConfig) -> None:
    try:
        serve(url, rank, world, local_rank, parallel)
    except SystemExit as e:
        _exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        _exit_now(1)
    _exit_now(0)


def spawned_worker_main(url: str, rank: int, world: int, parallel: ParallelConfig,
                        parent_pid: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    # the ranks share this host's cores; this process is ours
    if torch.get_num_threads() > cores_per_rank(world):
        set_process_threads(cores_per_rank(world))
    _serve_then_exit(url, rank, world, rank, parallel)


def serve_from_env(parallel: ParallelConfig) -> None:
    """A rank other than 0 under an external launcher: serve rank 0 until it closes the engine, then
    end the process (the script's code after LLM(...) is rank 0's)."""
    parallel.check_world()
    _serve_then_exit(parallel.init_method(), parallel.rank, parallel.tensor_parallel_size,
                     parallel.local_rank, parallel)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlinfer.engine.worker",
        description="Serve as a tensor-parallel worker (rank > 0) of a vlinfer engine.")
    parser.add_argument(
        "--init-method", default=None, help="tcp://host:port of rank 0 (default: env://, i.e. "
        "MASTER_ADDR / MASTER_PORT)")
    parser.add_argument("--rank", type=int, default=None, help="default: $RANK")
    parser.add_argument("--world-size", type=int, default=None,
                        help="= tensor_parallel_size (default: $WORLD_SIZE)")
    parser.add_argument(
        "--local-rank", type=int, default=None, help="accelerator index on this node "
        "(default: $LOCAL_RANK, else the rank)")
    parser.add_argument(
        "--timeout", type=float, default=EngineConfig.distributed_timeout_s,
        help="seconds a step's collective may wait (match rank 0's distributed_timeout_s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    world = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    local_rank = args.local_rank if args.local_rank is not None else int(
        os.environ.get("LOCAL_RANK", rank))
    if rank == 0:
        parser.error("rank 0 runs the engine (LLM(..., tensor_parallel_size=N)), not this worker")
    if not 0 < args.timeout < float("inf"):
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    parallel = ParallelConfig(world, args.init_method, args.timeout,
                              EngineConfig.distributed_startup_timeout_s)
    _serve_then_exit(args.init_method or "env://", rank, world, local_rank, parallel)


if __name__ == "__main__":
    main()
