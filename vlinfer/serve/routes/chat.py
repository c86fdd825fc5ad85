"""POST /v1/chat/completions: a conversation (images and videos fetched on the event loop, decoded
and templated in a worker thread) queued as n sequences, answered in the chat completion shape,
streamed as chunks or whole, with tool calls parsed out of the text."""
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vlinfer.serve import media
from vlinfer.serve.body import read_json
from vlinfer.serve.constraints import forced_tool
from vlinfer.serve.protocol import ChatCompletionRequest
from vlinfer.serve.responses import (Logprobs, finished_outputs, new_id, now, reasoning_fields,
                                     stream_response, usage)
from vlinfer.serve.run import Run
from vlinfer.serve.tool_calls import ToolCallParser, parse_tool_calls

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    server = request.app.state.server
    engine, config = server.engine, server.config
    req = await read_json(request, ChatCompletionRequest)
    model, adapter = server.model(req.model)
    server.check_generates()
    media.check_mm_kwargs(req.mm_processor_kwargs, engine, config)
    fmt = Logprobs(req.top_logprobs or 0) if req.logprobs else None
    params = server.sampling_params(req, (req.top_logprobs or 0) if req.logprobs else None)
    server.check_capacity(req.n)
    sources = media.image_sources(req.messages, engine, config)
    videos = media.video_sources(media.content_lists(req.messages))
    fetched = await media.fetch_urls(sources, config.images, videos)

    def prompts():
        return [server.chat_prompt(req.messages, sources, fetched, req.mm_processor_kwargs,
                                   req.tools, chat_template_kwargs=req.chat_template_kwargs)]
    run = await server.start(request, prompts, params, req.n, 1,
                             req.max_completion_tokens or req.max_tokens, adapter)
    return await respond(request, run, req, model, fmt)


async def respond(request: Request, run: Run, req: ChatCompletionRequest, model: str,
                  fmt: Logprobs | None) -> Response:
    """A started run's chat completion, streamed (SSE chunks) or whole."""
    request_id, created = new_id("chatcmpl"), now()
    headers = {"X-Request-Id": request_id}
    count = len(run.streams)
    tools = _tool_mode(req)
    if req.stream:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model}
        sent = [0] * count  # per choice: tokens whose logprobs went out
        parsers = [ToolCallParser(tools == "bare", _max_calls(req))
                   for _ in range(count)] if tools else None

        def chunk(item):
            if item is None:  # before any token: the stream opens each choice with its role
                return [{**head, "choices": [{"index": i,
                                              "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                        for i in range(count)]
            i, out, new_tokens = item
            c = out.outputs[0]
            logprobs = fmt.chat(out, sent[i], sent[i] + new_tokens) if fmt else None
            sent[i] += new_tokens
            finish = c.finish_reason
            if parsers:  # content and tool call deltas; a possible start of <tool_call> waits
                delta = parsers[i].feed(c.delta_text, final=finish is not None).openai()
                finish = _finish_reason(finish, parsers[i].calls)
            else:
                delta = {"content": c.delta_text} if c.delta_text else {}
            if c.delta_reasoning:  # the thinking, apart from the answer (vLLM's two names)
                delta = {**reasoning_fields(c.delta_reasoning), **delta}
            if not (delta or finish or logprobs):
                return None  # e.g. held back as a possible stop string, or half a character
            return {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]}

        def usage_chunk():
            return {**head, "choices": [], "usage": usage(run, req.n)}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(request, run, chunk, usage_chunk, include, headers)
    choices = []
    for i, out in enumerate(await finished_outputs(request, run)):
        c = out.outputs[0]
        finish = c.finish_reason
        if tools:
            content, calls = parse_tool_calls(c.text, tools == "bare", _max_calls(req))
            message = {"role": "assistant",
                       "content": None if calls and not content.strip() else content}
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            finish = _finish_reason(finish, calls)
        else:
            message = {"role": "assistant", "content": c.text}
        if c.reasoning is not None:
            message.update(reasoning_fields(c.reasoning))
        logprobs = fmt.chat(out, 0, len(c.token_ids)) if fmt else None
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": finish})
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                         "model": model, "choices": choices, "usage": usage(run, req.n)},
                        headers=headers)


def _tool_mode(req: ChatCompletionRequest) -> str | None:
    """How the answer's tool calls are read: None (no tools, or tool_choice "none": the text is
    content), "auto" (<tool_call> blocks anywhere in the text; tool_choice "required" constrains it
    to such blocks) or "bare" (a named function: the constrained text is the call object itself)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return "bare" if forced_tool(req) not in (None, "*") else "auto"


def _max_calls(req: ChatCompletionRequest) -> int | None:
    return 1 if req.parallel_tool_calls is False else None


def _finish_reason(reason: str | None, calls: list) -> str | None:
    """An answer that ended by itself after calling tools finished to have them run (OpenAI's
    "tool_calls"); one cut by max_tokens keeps "length", so a truncated call is never mistaken for a
    complete one."""
    return "tool_calls" if calls and reason == "stop" else reason
