"""What every route's response shares: ids, usage, OpenAI logprobs, and a started Run answered
streamed (server-sent events) or whole. A client that goes away mid-run has its sequences aborted at
once. Each route's module (serve/routes/) builds its own body from these."""
import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from vlinfer.serve.errors import ApiError
from vlinfer.serve.run import Run

logger = logging.getLogger("vlinfer.serve")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(run: Run, n: int) -> dict:
    """A generating run's usage: each prompt counted once (as OpenAI does for n > 1), its cached
    tokens from its first sequence."""
    firsts = [out for i, out in enumerate(run.last) if i % n == 0 and out is not None]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(out.outputs[0].token_ids) for out in run.last if out is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def reasoning_fields(text: str) -> dict:
    """The thinking in a message, delta or choice: vLLM's `reasoning` and its older name
    `reasoning_content`, which OpenAI clients read."""
    return {"reasoning": text, "reasoning_content": text}


def pooling_usage(prompt_tokens: int) -> dict:
    """The usage of an embedding or scoring request: prompt tokens only."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


class Logprobs:
    """Formats the engine's per-token {token_id: Logprob} dicts (top-k plus the chosen token) the
    OpenAI way: the same raw logprobs and token texts (Logprob.decoded_token) LLM.generate
    returns."""

    def __init__(self, top: int):
        self.top = top

    def _top(self, entry: dict) -> list:
        return sorted(entry.values(), key=lambda lp: -lp.logprob)[:self.top]

    @staticmethod
    def _slice(out, start: int, end: int) -> tuple[list, list]:
        """Output tokens [start, end) and their entries. Index by count, not by taking the list
        whole: the engine shares one growing list with every output of a request, and its loop
        thread may have appended past `out` already."""
        return out.outputs[0].token_ids[start:end], out.outputs[0].logprobs[start:end]

    def chat(self, out, start: int, end: int) -> dict:
        content = []
        for token_id, entry in zip(*self._slice(out, start, end)):
            chosen = entry[token_id]
            top = [{"token": lp.decoded_token, "logprob": lp.logprob,
                    "bytes": list(lp.decoded_token.encode())} for lp in self._top(entry)]
            content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                            "bytes": list(chosen.decoded_token.encode()), "top_logprobs": top})
        return {"content": content}

    def completion(self, out, start: int, end: int, text_offset: int = 0) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(*self._slice(out, start, end)):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            tops.append({lp.decoded_token: lp.logprob for lp in self._top(entry)})
            offsets.append(text_offset)
            text_offset += len(chosen.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


# ---- a run answered ----
def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _watch_disconnect(request: Request, run: Run) -> None:
    """Abort the run when the client goes away. The body was read already, so the next message is
    the disconnect (or, once the response is complete, uvicorn's own disconnect, after which close()
    is a no-op)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.close()
            return


class _SSEResponse(StreamingResponse):
    """Closes its generator however streaming ends, so the generator's finally (abort) runs at once
    on a disconnect rather than whenever the garbage collector finalizes it."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


async def _stream(request: Request, run: Run, chunk_fn, usage_chunk_fn, include_usage: bool):
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        for first in chunk_fn(None):
            yield sse(first)
        async for index, out, new_tokens in run.outputs():
            chunk = chunk_fn((index, out, new_tokens))
            if chunk is not None:
                yield sse(chunk)
        if include_usage:
            yield sse(usage_chunk_fn())
        yield sse("[DONE]")
    except Exception:  # noqa: BLE001 - headers sent: report in the stream, trace to the log
        logger.exception("generation failed mid-stream")
        yield sse({"error": {"message": "internal error while generating; see the server log",
                             "type": "server_error", "param": None, "code": "internal_error"}})
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        run.close()


def stream_response(request: Request, run: Run, chunk_fn, usage_chunk_fn, include_usage: bool,
                    headers: dict) -> StreamingResponse:
    """A run streamed as server-sent events: chunk_fn(None) gives the opening chunks, then
    chunk_fn((index, output, new tokens)) each output's chunk (None: nothing to send), then the
    usage chunk if asked for, then [DONE]."""
    return _SSEResponse(_stream(request, run, chunk_fn, usage_chunk_fn, include_usage),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", **headers})


async def finished_outputs(request: Request, run: Run) -> list:
    """The final output of each of a run's sequences, once all finished (a run answered whole, not
    streamed)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        async for _ in run.outputs():
            pass
    finally:
        watcher.cancel()
        run.close()
    if any(out is None or not out.finished for out in run.last):
        # Only reached when the client went away (nobody reads this) or a sequence was aborted
        # under it.
        raise ApiError(499, "the request was aborted before it finished", code="aborted")
    return run.last
