"""A stand-in for torch.cuda.CUDAGraph on CPU tensors, for vlinfer/ops/cuda/graph.py's backend
under the Triton interpreter: what a capture records is what a replay runs, and nothing else.

A CUDA graph holds kernels with their launch arguments: device pointers (the graph's static
memory) and host scalars, both fixed at capture. So here a capture records every aten op with its
tensors (re-executed on the same tensors at replay, a fresh output copied into the tensor the
capture returned) and every Triton launch as one task (kernel, grid and arguments as launched:
tensors by reference, Python ints and floats by value; re-launched at replay), and Python does not
run again at replay: a value read on the host at capture, or a tensor built from host values then,
stays what it was. A capture refuses what CUDA refuses while a stream is capturing: a value read
back to the host (.item(), .tolist(), bool(), an op returning a host scalar), an op whose output
shape depends on tensor values, torch.cuda.synchronize.

Not emulated: the device's memory reuse inside the graph's pool (recorded tensors stay alive here),
streams, and the kernels' compiled code (the interpreter runs them). tests/fakes/fake_torch_npu.py
records ACL graphs the same way (its _AtenTask is reused)."""
import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fake_torch_npu import DATA_DEPENDENT, _AtenTask, _snapshot, _tensors


class CaptureError(RuntimeError):
    """What the CUDA runtime raises for an operation a capturing stream does not permit."""


class _LaunchTask:
    """One Triton kernel launch, re-issued at replay with its captured grid and arguments."""

    def __init__(self, fn, grid, args, kwargs):
        self.fn, self.grid = fn, grid
        self.args, self.kwargs = _snapshot(args), _snapshot(kwargs)

    def replay(self, state):
        with state.inside():
            state.launch(self.fn, *self.args, grid=self.grid, warmup=False, **self.kwargs)


class _AtenReplay:
    def __init__(self, task):
        self.task = task

    def replay(self, state):
        self.task.replay()


class _State:
    def __init__(self, launch):
        self.capturing = None  # the FakeCUDAGraph being captured
        self.depth = 0  # > 0 inside a Triton launch: its own tensor traffic is the kernel's
        self.launch = launch  # the interpreter's launch (InterpretedFunction.run)
        self.launches = 0  # kernel launches replayed (tests)

    @contextlib.contextmanager
    def inside(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


class _Recorder(TorchDispatchMode):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.state.depth:
            return func(*args, **kwargs)
        name = func._schema.name
        if any("Tensor" not in str(r.type) for r in func._schema.returns):
            raise CaptureError(f"{name} returns a host value while capturing: a device->host sync")
        static = name == "aten::repeat_interleave" and func._overloadname == "self_int"
        if (name in DATA_DEPENDENT and not static) or (
                name in ("aten::index", "aten::index_put_", "aten::index_put") and
                any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))):
            raise CaptureError(f"{name} has a data-dependent output shape: it cannot be captured")
        result = func(*args, **kwargs)
        self.state.capturing.tasks.append(_AtenReplay(_AtenTask(func, args, kwargs, result)))
        return result


def install(monkeypatch):
    """torch.cuda.CUDAGraph / graph / synchronize emulated, Triton launches recorded while
    capturing (the interpreter must be on: TRITON_INTERPRET=1 before the kernels load). Returns
    the emulation's state (its `launches` counts replayed kernel launches)."""
    from triton.runtime.interpreter import InterpretedFunction
    state = _State(InterpretedFunction.run)

    def run(fn, *args, grid, warmup, **kwargs):
        if state.capturing is None or state.depth or warmup:
            with state.inside():
                return state.launch(fn, *args, grid=grid, warmup=warmup, **kwargs)
        if callable(grid):
            raise CaptureError("a launch grid computed at launch: not what our kernels do")
        state.capturing.tasks.append(_LaunchTask(fn, grid, args, kwargs))
        with state.inside():
            return state.launch(fn, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)

    class FakeCUDAGraph:
        def __init__(self):
            self.tasks, self.captured, self.replays = [], False, 0
            self._pool = object()

        def pool(self):
            return self._pool

        def replay(self):
            if not self.captured or state.capturing is not None:
                raise CaptureError("replay of a graph not captured, or during a capture")
            for task in self.tasks:
                if isinstance(task, _LaunchTask):
                    state.launches += 1
                task.replay(state)
            self.replays += 1

    def host_read_refused(original, what):
        def read(self, *a, **k):
            if state.capturing is not None and not state.depth:
                raise CaptureError(f"{what} while capturing: a device->host sync")
            return original(self, *a, **k)
        return read

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode=None):
        if state.capturing is not None:
            raise CaptureError("a capture is already running")
        if pool is not None:
            cuda_graph._pool = pool
        cuda_graph.tasks, state.capturing = [], cuda_graph
        with contextlib.ExitStack() as undo:
            for name in ("tolist", "__bool__"):  # read on the host without an aten op
                _setattr_until(undo, torch.Tensor, name,
                               host_read_refused(getattr(torch.Tensor, name), f".{name}()"))
            try:
                with _Recorder(state):
                    yield cuda_graph
            finally:
                state.capturing = None
        cuda_graph.captured = True

    def synchronize(device=None):
        if state.capturing is not None:
            raise CaptureError("torch.cuda.synchronize() while capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return state


def _setattr_until(stack: contextlib.ExitStack, owner, name: str, value) -> None:
    """setattr, undone when `stack` closes (the capture's end): the class's own attribute put back,
    or none where it inherited one."""
    own = owner.__dict__.get(name, _MISSING)
    setattr(owner, name, value)
    stack.callback(lambda: delattr(owner, name) if own is _MISSING else setattr(owner, name, own))


_MISSING = types.SimpleNamespace()
