"""An LLMEngine driven by one background thread, so many callers (demo tabs, server requests) share
one batch.

Callers submit from any thread and read their request's outputs from a queue; the loop thread is the
only one that touches the engine's requests and steps it. Validation and image preprocessing run in
the caller's thread, so a slow image never stalls the batch. A submit or an abort only puts the
request (or its id) in an inbox under a lock that is never held during a step, so neither waits for
the step in progress; the loop thread takes the inbox into the engine between steps."""
import asyncio
import itertools
import logging
import queue
import threading

from vlinfer.engine.drive import step
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.engine.sequence import Sequence
from vlinfer.outputs import PoolingRequestOutput, RequestOutput
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams

logger = logging.getLogger("vlinfer")
_DONE = object()


class RequestStream:
    """Iterates over one request's outputs (cumulative text plus this step's delta) until it
    finishes; a pooling request's one output is its PoolingRequestOutput."""

    def __init__(self, loop: "EngineLoop", request_id: str):
        self.loop = loop
        self.request_id = request_id
        self.queue: queue.Queue = queue.Queue()
        self.final: RequestOutput | PoolingRequestOutput | None = None

    def _accept(self, item) -> bool:
        """False at the end of the stream; raises the loop's error; remembers the final output."""
        if item is _DONE:
            return False
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.final = item
        return True

    def __iter__(self):
        while True:
            item = self.queue.get()
            if not self._accept(item):
                return
            yield item

    def deltas(self):
        for out in self:
            if out.outputs[0].delta_text:
                yield out.outputs[0].delta_text

    def abort(self) -> None:
        self.loop.abort(self.request_id)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # Guards the streams, the two inboxes and _closed; held for a few list / dict operations,
        # never for a step.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._streams: dict[str, RequestStream] = {}
        self._new_seqs: list[Sequence] = []  # submitted, not yet in the engine
        self._aborted: list[str] = []  # request ids to abort in the engine before its next step
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vlinfer-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt, sampling_params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; raises ValueError here, in the caller, when the request is bad."""
        return self.submit_sequences([self.make_sequence(prompt, sampling_params)])[0]

    def make_sequence(self, prompt, sampling_params: SamplingParams | None = None) -> Sequence:
        """Validate a request and build its Sequence without queueing it (ValueError when bad), so a
        caller with several requests (n > 1) can check them all before any runs. Runs in the
        caller's thread."""
        return self.engine.make_sequence(prompt, sampling_params,
                                         request_id=f"loop-{next(self._ids)}")

    def make_sequences(self, prompt, sampling_params: SamplingParams | PoolingParams,
                       lora_request=None) -> list[Sequence]:
        """make_sequence for n completions of one prompt: the prompt and its media are processed
        once (the engine's make_sequences), and each completion is its own stream (its outputs carry
        its own id). PoolingParams make one pooling sequence, whose stream gets one
        PoolingRequestOutput. lora_request: the adapter they run."""
        seqs = self.engine.make_sequences(prompt, sampling_params,
                                          request_id=f"loop-{next(self._ids)}",
                                          lora_request=lora_request)
        for seq in seqs:
            seq.parent_id = seq.request_id
        return seqs

    def submit_sequences(self, seqs: list[Sequence], event_loop=None) -> list[RequestStream]:
        """Queue Sequences from make_sequence, all in one engine step's admission. With an asyncio
        event_loop, the streams are AsyncRequestStreams read with `async for` on that loop: outputs
        reach them through call_soon_threadsafe, so no thread blocks per request. Never waits for a
        step: safe on an event loop."""
        if event_loop is not None:
            streams = [AsyncRequestStream(self, seq.request_id, event_loop) for seq in seqs]
        else:
            streams = [RequestStream(self, seq.request_id) for seq in seqs]
        with self._wakeup:
            # Checked under the lock: a request queued after the loop thread returned would never
            # finish.
            if not self.is_alive():
                raise RuntimeError("the engine loop is closed or stopped")
            for seq, stream in zip(seqs, streams):
                self._streams[seq.request_id] = stream
            self._new_seqs.extend(seqs)
            self._wakeup.notify()
        return streams

    def abort(self, request_id: str) -> None:
        """End a request's stream now; the engine frees its blocks before its next step. Never waits
        for a step."""
        with self._wakeup:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._aborted.append(request_id)
                self._wakeup.notify()
        if stream is not None:
            stream.queue.put(_DONE)

    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    def is_alive(self) -> bool:
        """False once closed or once the loop thread died: a health check reports it, readers stop
        waiting."""
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join(timeout=10)
        with self._lock:
            streams, self._streams = self._streams, {}
            self._new_seqs, self._aborted = [], []
        # else a step outlived the join: the engine is still the thread's
        if not self._thread.is_alive():
            for request_id in streams:
                self.engine.abort_request(request_id)
        for stream in streams.values():
            stream.queue.put(_DONE)

    def _take_inbox(self) -> bool:
        """Wait for work; move submitted and aborted requests into the engine. False once closed."""
        with self._wakeup:
            while not (self._closed or self._new_seqs or self._aborted or
                       self.engine.has_unfinished_requests()):
                self._wakeup.wait()
            if self._closed:
                return False
            new_seqs, self._new_seqs = self._new_seqs, []
            aborted, self._aborted = self._aborted, []
        for seq in new_seqs:
            self.engine.add_sequence(seq)
        # after the adds: a request aborted before it reached the engine is in it now
        for request_id in aborted:
            self.engine.abort_request(request_id)
        return True

    def _run(self) -> None:
        while self._take_inbox():
            if not self.engine.has_unfinished_requests():
                continue
            try:  # a failed step aborts every request in the engine: each is some stream's
                outputs = step(self.engine, self.engine.requests)
            except Exception as e:  # an engine fault fails the running requests, not the process
                # requests submitted during the failed step fail with it, never reaching the engine
                with self._lock:
                    streams, self._streams = self._streams, {}
                    self._new_seqs = []
                logger.exception("engine step failed; failing %d requests", len(streams))
                for stream in streams.values():
                    stream.queue.put(RuntimeError(f"engine step failed: {e}"))
                continue
            with self._lock:  # which streams still want outputs (an abort may have just taken one)
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        deliveries.append((stream, out))
                        if out.finished:
                            del self._streams[out.request_id]
            for stream, out in deliveries:
                stream.queue.put(out)
                if out.finished:
                    stream.queue.put(_DONE)


class _EventLoopQueue:
    """The queue of an AsyncRequestStream. put() runs in the loop thread and never blocks; get() is
    awaited."""

    def __init__(self, event_loop):
        self.event_loop = event_loop
        self.items = asyncio.Queue()  # binds to the event loop at its first await, not here

    def put(self, item) -> None:
        try:
            self.event_loop.call_soon_threadsafe(self.items.put_nowait, item)
        # the event loop is closed: nobody will read this, and the loop thread must go on
        except RuntimeError:
            pass

    async def get(self):
        return await self.items.get()


class AsyncRequestStream(RequestStream):
    """A RequestStream for asyncio code: `async for out in stream`. abort() never waits for a step,
    so an event loop may call it directly."""

    LIVENESS_CHECK_S = 1.0  # how often a waiting reader checks that the loop thread is still there

    def __init__(self, loop: "EngineLoop", request_id: str, event_loop):
        super().__init__(loop, request_id)
        self.queue = _EventLoopQueue(event_loop)

    def __iter__(self):
        raise TypeError("an AsyncRequestStream is read with `async for`")

    async def __aiter__(self):
        getter = None
        try:
            while True:
                # One get() stays pending across liveness checks: cancelling it on each timeout
                # could drop an item that arrives just then (Python < 3.12's wait_for can).
                getter = getter or asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=self.LIVENESS_CHECK_S)
                if not done:
                    # A dead loop thread puts nothing more: fail instead of waiting forever.
                    if not self.loop.is_alive():
                        raise RuntimeError("the engine loop stopped")
                    continue
                item, getter = getter.result(), None
                if not self._accept(item):
                    return
                yield item
        finally:
            if getter is not None:
                getter.cancel()
