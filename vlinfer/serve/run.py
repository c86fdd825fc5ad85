"""Run: one request in flight, its sequences' outputs merged into one stream, with the server's
metrics and the abort of whatever is unfinished when the request ends early."""
import asyncio
import time

from vlinfer.outputs import PoolingRequestOutput


def generated(out) -> list[int]:
    """The tokens a request generated so far: none for a pooling request (embed, score), whose one
    output is its PoolingRequestOutput."""
    return [] if isinstance(out, PoolingRequestOutput) else out.outputs[0].token_ids


def finish_reason(out) -> str | None:
    """Why a request finished: a pooling request ends when its prefill does ("stop", as the engine
    marks it)."""
    return "stop" if isinstance(out, PoolingRequestOutput) else out.outputs[0].finish_reason


class Run:
    """The sequences of one HTTP request (n choices, maybe several prompts): their outputs merged in
    arrival order, the server's metrics, and abort of whatever is unfinished when the request ends
    early."""

    def __init__(self, server, streams: list, arrival: float):
        self.server, self.streams, self.arrival = server, streams, arrival
        self.last = [None] * len(streams)  # latest RequestOutput per choice
        self.first_token_at = [None] * len(streams)
        self.done = [False] * len(streams)
        self.closed = False

    async def outputs(self):
        """Yields (index, RequestOutput or PoolingRequestOutput, number of new tokens) until every
        sequence finished."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out, self._account(0, out)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    queue.put_nowait((i, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((i, None, e))
            finally:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    remaining -= 1
                    continue
                yield i, out, self._account(i, out)
        finally:
            for task in tasks:
                task.cancel()

    def _account(self, i: int, out) -> int:
        t = time.perf_counter()
        previous = self.last[i]
        new_tokens = len(generated(out)) - (len(generated(previous)) if previous else 0)
        self.last[i] = out
        if self.first_token_at[i] is None and generated(out):
            self.first_token_at[i] = t
            self.server.metrics.ttft.observe(t - self.arrival)
        if out.finished:
            self._finish(i, finish_reason(out) or "abort", t)
        return new_tokens

    def _finish(self, i: int, reason: str, t: float) -> None:
        if self.done[i]:
            return
        self.done[i] = True
        self.server.sequence_done()
        m, out = self.server.metrics, self.last[i]
        m.finished.labels(reason=reason).inc()
        if out is None:
            return
        n = len(generated(out))
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.cached_tokens.inc(out.num_cached_tokens)
        m.generation_tokens.inc(n)
        if reason == "abort":  # cut short: its latencies would describe the client, not the server
            return
        m.e2e.observe(t - self.arrival)
        if n > 1 and self.first_token_at[i] is not None:
            m.tpot.observe((t - self.first_token_at[i]) / (n - 1))

    def close(self) -> None:
        """Abort what has not finished (client gone, error). An abort never waits for a step: it
        runs here, on the event loop."""
        if self.closed:
            return
        self.closed = True
        t = time.perf_counter()
        for i, stream in enumerate(self.streams):
            if not self.done[i]:
                stream.abort()
                self._finish(i, "abort", t)
