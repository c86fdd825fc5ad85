"""Rank 0's side of a tensor-parallel engine: starts (or meets) the workers, sends them each step,
notices when one fails, and shuts them all down.

Failures surface as TensorParallelError within seconds rather than as a hang:
- a worker that dies closes its sockets, so rank 0's next collective fails at once ("connection
  closed");
- a worker that raises writes its traceback to the store, then exits (same as dying, with the reason
  attached);
- a worker that hangs mid-step trips the device group's timeout (distributed_timeout_s);
- a watchdog thread polls spawned workers' liveness, so a worker lost while the engine is idle is
  reported
  by the next step before rank 0 sends it anything.
After a failure the engine is closed: its ranks may be mid-collective and can never be brought back
in step.

Workers never outlive the engine: the LLM closes them on close()/`with`, when garbage collected, and
at interpreter exit (weakref.finalize, which runs from atexit); SIGTERM to rank 0 closes them before
the process dies; Ctrl-C during a step is held until the step ends so the ranks stay in step; and
each spawned worker exits by itself when rank 0's process is gone (its sockets close, and a thread
watches its parent pid)."""
import logging
import os
import signal
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from vlinfer.distributed.comm import (ParallelConfig, TensorParallelError, connect_store,
                                      control_channel, device_group, host_store, rank_device)
from vlinfer.distributed.main_guard import GUARD_HINT, check_main_guard
from vlinfer.platform import cores_per_rank

logger = logging.getLogger("vlinfer")

WATCHDOG_INTERVAL_S = 0.5
SHUTDOWN_GRACE_S = 5.0


class _State:
    """Everything shutdown needs, held apart from the driver so weakref.finalize and the watchdog
    thread do not keep the driver alive."""

    def __init__(self):
        # rank -> spawned worker (empty when launched externally)
        self.procs: dict[int, mp.Process] = {}
        self.store = None
        self.channel = None
        self.group = None
        self.failure: str | None = None  # why the engine cannot continue
        self.in_step = False  # between sending a step and finishing it: ranks may be mid-collective
        self.closed = False
        self.lock = threading.Lock()


def _worker_error(store, rank: int) -> str | None:
    key = f"vlinfer/error/{rank}"
    try:
        if store is not None and store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # the store lives in this process, but be safe while shutting down
        return None
    return None


def _describe_exit(rank: int, proc: mp.Process) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


def _shutdown(state: _State, polite: bool = True) -> None:
    """Stop every worker and drop the groups. Idempotent; safe from atexit, a finalizer or a signal
    handler."""
    with state.lock:
        if state.closed:
            return
        state.closed = True
    told = False
    if polite and state.failure is None and not state.in_step and state.channel is not None:
        try:
            state.channel.broadcast(("shutdown",))
            told = True
        except Exception:
            pass
    deadline = time.monotonic() + (SHUTDOWN_GRACE_S if told else 0.5)  # the rest are terminated
    for proc in state.procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in state.procs.values():
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for proc in state.procs.values():
        try:
            proc.close()  # releases the sentinel pipe
        except ValueError:
            pass
    state.channel = state.group = state.store = None
    _LIVE.discard(state)
    if not _LIVE:
        _restore_sigterm_handler()


_LIVE: set = set()  # states of open drivers, for the SIGTERM handler
_previous_sigterm = None


def _on_sigterm(signum, frame):
    for state in list(_LIVE):
        _shutdown(state, polite=False)
    signal.signal(signal.SIGTERM, _previous_sigterm or signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die as the sender intended, now without orphans


def _install_sigterm_handler() -> None:
    """Close workers on SIGTERM too (atexit does not run then). Only where the process has no
    handler of its own, and only from the main thread (Python's rule for signal handlers)."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current not in (signal.SIG_DFL, None):
        return
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _restore_sigterm_handler() -> None:
    """The last driver closed: the process's SIGTERM goes back to what it was before the first one
    (a handler left behind would outlive every engine). Signal handlers can only be set from the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _previous_sigterm or signal.SIG_DFL)


def _watchdog(state_ref) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        state = state_ref()
        if state is None or state.closed:
            return
        if state.failure is None:
            for rank, proc in state.procs.items():
                if not proc.is_alive():
                    error = _worker_error(state.store, rank)
                    state.failure = _describe_exit(
                        rank, proc) + (f"; it raised:\n{error}" if error else "")
                    logger.error("%s", state.failure)
                    break
        del state


class TPDriver:
    def __init__(self, parallel: ParallelConfig, device_type: str, worker_main):
        """worker_main(url, rank, world, parallel, parent_pid): what each spawned worker process
        runs (the engine's worker loop, vlinfer/engine/worker.py; passed in, since the engine sits
        above this package)."""
        parallel.check_world()
        self.worker_main = worker_main
        self.parallel = parallel
        self.world = parallel.tensor_parallel_size
        self.step_timeout = timedelta(seconds=parallel.distributed_timeout_s)
        self.startup_timeout = timedelta(seconds=parallel.distributed_startup_timeout_s)
        self.state = _State()
        self._finalizer = weakref.finalize(self, _shutdown, self.state)
        _LIVE.add(self.state)
        _install_sigterm_handler()
        self.device = rank_device(device_type, parallel.local_rank)
        # All ranks share one host's memory when spawned; externally, LOCAL_WORLD_SIZE ranks share a
        # node.
        self.local_world_size = self.world if not parallel.launched_externally else \
            int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if self.device.type == "cpu" and torch.get_num_threads() > cores_per_rank(
                self.local_world_size):
            # The ranks on this host share its cores, and more intra-op threads than cores is far
            # slower than fewer; the thread count is the process owner's to set
            # (docs/tensor-parallel.md), never a side effect.
            logger.warning(
                "tensor parallel on cpu: rank 0 runs %d intra-op threads while %d ranks share %d "
                "cores; "
                "give it %d (torch.set_num_threads, before LLM(...); the CLI's --num-threads does "
                "it)",
                torch.get_num_threads(), self.local_world_size,
                os.cpu_count() or 1, cores_per_rank(self.local_world_size))
        self.url = parallel.init_method()
        try:
            if not parallel.launched_externally:
                check_main_guard()  # the workers would import an unguarded script again
                # returns at once: the workers start while rank 0 reads the tokenizer and weights
                self._spawn()
        except BaseException:
            self.close(polite=False)
            raise

    @property
    def group(self):
        return self.state.group

    def _spawn(self) -> None:
        state = self.state
        state.store, self.url = host_store(self.url, self.startup_timeout)
        context = mp.get_context("spawn")
        for rank in range(1, self.world):
            proc = context.Process(target=self.worker_main, name=f"vlinfer-tp-worker-{rank}",
                                   daemon=True,
                                   args=(self.url, rank, self.world, self.parallel, os.getpid()))
            proc.start()
            state.procs[rank] = proc
        threading.Thread(target=_watchdog, args=(weakref.ref(state),), name="vlinfer-tp-watchdog",
                         daemon=True).start()

    def start_workers(self, init: dict) -> None:
        """Meet the workers, send them what they need to build their shard of the model, join the
        device group. They then load their shards while rank 0 loads its own; wait_ready() waits for
        them."""
        state = self.state
        try:
            if state.store is None:  # launched externally: meet at the launcher's address
                state.store = connect_store(self.url, 0, self.world, self.startup_timeout)
            self._wait_for("hello", "connect")
            state.channel = control_channel(state.store, 0, self.world, self.step_timeout,
                                            self.startup_timeout)
            logger.info("tensor parallel: %d ranks connected via %s", self.world, self.url)
            state.channel.broadcast(("init", init))
            state.group = device_group(state.store, 0, self.world, self.device, self.step_timeout,
                                       self.startup_timeout)
        except BaseException:
            self.close(polite=False)
            raise

    def wait_ready(self) -> None:
        self._wait_for("ready", "load the model")

    def _wait_for(self, what: str, doing: str) -> None:
        """Wait until every worker set vlinfer/<what>/<rank>, failing fast when one dies or reports
        an error."""
        store, deadline = self.state.store, time.monotonic() + self.startup_timeout.total_seconds()
        for rank in range(1, self.world):
            key = f"vlinfer/{what}/{rank}"
            while not store.check([key]):
                self._raise_if_worker_failed(doing)
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {rank} did not {doing} within "
                        f"{self.startup_timeout.total_seconds():.0f} s")
                time.sleep(0.05)

    def _raise_if_worker_failed(self, doing: str) -> None:
        for rank in range(1, self.world):
            error = _worker_error(self.state.store, rank)
            proc = self.state.procs.get(rank)
            if error is None and (proc is None or proc.is_alive()):
                continue
            message = _describe_exit(rank, proc) if proc is not None and not proc.is_alive() else \
                f"tensor-parallel worker rank {rank} failed"
            message += f" while trying to {doing}"
            if error:
                message += f"; it raised:\n{error}"
            elif proc is not None and doing == "connect":
                message += f" ({GUARD_HINT})"
            raise TensorParallelError(message)

    # ---- steps ----
    def check(self) -> None:
        if self.state.failure is not None:
            self._fail(None)
        if self.state.closed:
            raise TensorParallelError("the tensor-parallel engine is closed")

    def call(self, *message) -> None:
        """Send a command every worker runs; rank 0 then runs the same locally."""
        self.check()
        try:
            self.state.channel.broadcast(message)
        except Exception as e:
            self._fail(e)

    def gather(self, obj) -> list:
        """Every rank's report: rank 0 passes its own, the workers answer a ("describe",) call."""
        try:
            return self.state.channel.gather(obj)
        except Exception as e:
            self._fail(e)

    @contextmanager
    def step(self, inputs):
        """Send one step's inputs to the workers; the body runs rank 0's share. An error inside
        (here or on any rank) ends the engine with a TensorParallelError naming the rank that
        failed."""
        self.check()
        state = self.state
        with _defer_sigint() as interrupted:
            state.in_step = True
            try:
                state.channel.broadcast(("step", inputs))
                yield
            except BaseException as e:
                self._fail(e)
            state.in_step = False
        if interrupted():
            raise KeyboardInterrupt

    def _fail(self, exc: BaseException | None):
        """Find out which rank failed and why, close the engine and raise TensorParallelError."""
        state = self.state
        if isinstance(exc, KeyboardInterrupt):
            state.failure = state.failure or "interrupted twice during a tensor-parallel step"
            self.close(polite=False)
            raise exc
        if state.failure is None:
            state.failure = self._diagnose(exc)
        message = state.failure
        self.close(polite=False)
        if exc is None:
            raise TensorParallelError(f"{message}; the engine is closed, create a new LLM")
        raise TensorParallelError(f"{message}; the engine is closed, create a new LLM") from exc

    def _diagnose(self, exc: BaseException | None) -> str:
        # A worker that raised writes its error before it exits, and a dead one is reaped within
        # moments: give both a short while to show, so the message names the cause rather than the
        # symptom.
        deadline = time.monotonic() + 3.0
        while True:
            for rank in range(1, self.world):
                error = _worker_error(self.state.store, rank)
                proc = self.state.procs.get(rank)
                if error is not None:
                    who = _describe_exit(rank, proc) \
                        if proc is not None and not proc.is_alive() else \
                        f"tensor-parallel worker rank {rank}"
                    return f"{who}; it raised:\n{error}"
                if proc is not None and not proc.is_alive():
                    return _describe_exit(rank, proc)
            if time.monotonic() > deadline or not self.state.procs:
                break
            time.sleep(0.05)
        text = "".join(
            traceback.format_exception_only(exc)).strip() if exc is not None else "unknown error"
        if "Timed out" in text or "timed out" in text:
            return (f"a tensor-parallel rank did not answer within distributed_timeout_s="
                    f"{self.parallel.distributed_timeout_s:g} ({text})")
        return f"tensor-parallel step failed on rank 0: {text}"

    def close(self, polite: bool = True) -> None:
        if polite:
            self._finalizer()
        else:
            _shutdown(self.state, polite=False)
            self._finalizer.detach()

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.state.procs.items()}


@contextmanager
def _defer_sigint():
    """Hold a Ctrl-C that arrives during a step until the step has finished on every rank (a step
    cut short leaves the workers inside a collective rank 0 never joins). A second Ctrl-C interrupts
    at once."""
    caught = []

    def handler(signum, frame):
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)
        logger.warning(
            "Ctrl-C: stopping after the current tensor-parallel step (again to interrupt now)")

    install = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if install:
        signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(caught)
    finally:
        if install:
            signal.signal(signal.SIGINT, signal.default_int_handler)
