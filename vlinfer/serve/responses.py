"""A started run's response, in the chat or the text completion shape: streamed as SSE chunks or whole as one
JSON body, with logprobs, usage, and tool calls parsed out of the text. A client that goes away mid-run has its
sequences aborted at once."""
import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlinfer.serve.constraints import forced_tool
from vlinfer.serve.protocol import ApiError, Logprobs, new_id, now, sse, usage
from vlinfer.serve.run import Run
from vlinfer.serve.tool_calls import ToolCallParser, parse_tool_calls

logger = logging.getLogger("vlinfer.serve")


def _choice_logprobs(fmt: Logprobs | None, out, start: int, end: int, chat: bool, text_offset: int = 0):
    """Logprobs of output tokens [start, end). Index by count, not by taking the list whole: the engine shares
    one growing list with every output of a request, and its loop thread may have appended past `out` already."""
    if fmt is None:
        return None
    token_ids = out.outputs[0].token_ids[start:end]
    entries = out.outputs[0].logprobs[start:end]
    return fmt.chat(token_ids, entries) if chat else fmt.completion(token_ids, entries, text_offset)


def _usage(run: Run, n: int) -> dict:
    """Each prompt counted once (as OpenAI does for n > 1), its cached tokens from its first sequence."""
    firsts = [out for i, out in enumerate(run.last) if i % n == 0 and out is not None]
    completion = sum(len(out.outputs[0].token_ids) for out in run.last if out is not None)
    return usage(sum(len(o.prompt_token_ids) for o in firsts), completion, sum(o.num_cached_tokens for o in firsts))


async def _watch_disconnect(request: Request, run: Run) -> None:
    """Abort the run when the client goes away. The body was read already, so the next message is the
    disconnect (or, once the response is complete, uvicorn's own disconnect, after which close() is a no-op)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.close()
            return


class _SSEResponse(StreamingResponse):
    """Closes its generator however streaming ends, so the generator's finally (abort) runs at once on a
    disconnect rather than whenever the garbage collector finalizes it."""

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
    except Exception:  # noqa: BLE001 - headers are sent: report in the stream, keep the trace in the log
        logger.exception("generation failed mid-stream")
        yield sse({"error": {"message": "internal error while generating; see the server log",
                             "type": "server_error", "param": None, "code": "internal_error"}})
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        run.close()


async def _collect(request: Request, run: Run) -> None:
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        async for _ in run.outputs():
            pass
    finally:
        watcher.cancel()
        run.close()


async def finished_outputs(request: Request, run: Run) -> list:
    """The final output of each of a run's sequences, once all finished (a run answered whole, not streamed)."""
    await _collect(request, run)
    _check_complete(run)
    return run.last


async def respond(request: Request, run: Run, req, model: str, chat: bool, fmt: Logprobs | None) -> Response:
    """The response of a started run, in the chat or the text completion shape, streamed (SSE) or whole."""
    request_id, created = new_id("chatcmpl" if chat else "cmpl"), now()
    kind = "chat.completion" if chat else "text_completion"
    headers = {"X-Request-Id": request_id}
    count = len(run.streams)
    tools = _tool_mode(req) if chat else None
    if req.stream:
        head = {"id": request_id, "object": kind + (".chunk" if chat else ""), "created": created, "model": model}
        sent, offsets = [0] * count, [0] * count  # per choice: tokens whose logprobs went out, text length
        parsers = [ToolCallParser(tools == "bare", _max_calls(req)) for _ in range(count)] if tools else None

        def chunk(item):
            if item is None:  # before any token: a chat stream opens each choice with its role
                return [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                        for i in range(count)] if chat else []
            i, out, new_tokens = item
            c = out.outputs[0]
            logprobs = _choice_logprobs(fmt, out, sent[i], sent[i] + new_tokens, chat, offsets[i])
            sent[i], offsets[i] = sent[i] + new_tokens, offsets[i] + len(c.delta_text)
            finish = c.finish_reason
            if not chat:
                body = {"text": c.delta_text}
            elif parsers:  # content and tool call deltas; a possible start of <tool_call> waits for more
                body = {"delta": parsers[i].feed(c.delta_text, final=finish is not None).openai()}
                finish = _finish_reason(finish, parsers[i].calls)
            else:
                body = {"delta": {"content": c.delta_text} if c.delta_text else {}}
            if not (body.get("text") or body.get("delta") or finish or logprobs):
                return None  # e.g. held back as a possible stop string, or half a multi-byte character
            return {**head, "choices": [{"index": i, **body, "logprobs": logprobs, "finish_reason": finish}]}

        def usage_chunk():
            return {**head, "choices": [], "usage": _usage(run, req.n)}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(_stream(request, run, chunk, usage_chunk, include), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", **headers})
    choices = []
    for i, out in enumerate(await finished_outputs(request, run)):
        c = out.outputs[0]
        finish = c.finish_reason
        if not chat:
            body = {"text": c.text}
        elif tools:
            content, calls = parse_tool_calls(c.text, tools == "bare", _max_calls(req))
            message = {"role": "assistant", "content": None if calls and not content.strip() else content}
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            body, finish = {"message": message}, _finish_reason(finish, calls)
        else:
            body = {"message": {"role": "assistant", "content": c.text}}
        choices.append({"index": i, **body, "logprobs": _choice_logprobs(fmt, out, 0, len(c.token_ids), chat),
                        "finish_reason": finish})
    return JSONResponse({"id": request_id, "object": kind, "created": created, "model": model, "choices": choices,
                         "usage": _usage(run, req.n)}, headers=headers)


def _tool_mode(req) -> str | None:
    """How the answer's tool calls are read: None (no tools, or tool_choice "none": the text is content),
    "auto" (<tool_call> blocks anywhere in the text; tool_choice "required" constrains it to such blocks) or "bare"
    (a named function: the constrained text is the call object itself)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return "bare" if forced_tool(req) not in (None, "*") else "auto"


def _max_calls(req) -> int | None:
    return 1 if req.parallel_tool_calls is False else None


def _finish_reason(reason: str | None, calls: list) -> str | None:
    """An answer that ended by itself after calling tools finished to have them run (OpenAI's "tool_calls"); one
    cut by max_tokens keeps "length", so a truncated call is never mistaken for a complete one."""
    return "tool_calls" if calls and reason == "stop" else reason


def _check_complete(run: Run) -> None:
    if any(out is None or not out.finished for out in run.last):
        # Only reached when the client went away (nobody reads this) or a sequence was aborted under it.
        raise ApiError(499, "the request was aborted before it finished", code="aborted")

