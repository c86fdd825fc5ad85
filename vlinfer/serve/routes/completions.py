"""POST /v1/completions: text or token-id prompts (several per request) queued as n sequences each,
answered in the text completion shape, streamed as chunks or whole."""
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vlinfer.serve.body import read_json
from vlinfer.serve.protocol import CompletionRequest
from vlinfer.serve.responses import (Logprobs, finished_outputs, new_id, now, reasoning_fields,
                                     stream_response, usage)
from vlinfer.serve.run import Run

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    server = request.app.state.server
    req = await read_json(request, CompletionRequest)
    model, adapter = server.model(req.model)
    server.check_generates()
    fmt = Logprobs(req.logprobs) if req.logprobs is not None else None
    params = server.sampling_params(req, req.logprobs)
    prompts = server.completion_prompts(req.prompt)
    server.check_capacity(req.n * len(prompts))
    run = await server.start(request, lambda: prompts, params, req.n, len(prompts), req.max_tokens,
                             adapter)
    return await respond(request, run, req, model, fmt)


async def respond(request: Request, run: Run, req: CompletionRequest, model: str,
                  fmt: Logprobs | None) -> Response:
    """A started run's text completion, streamed (SSE chunks) or whole."""
    request_id, created = new_id("cmpl"), now()
    headers = {"X-Request-Id": request_id}
    if req.stream:
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        # per choice: tokens whose logprobs went out, text length sent
        sent, offsets = [0] * len(run.streams), [0] * len(run.streams)

        def chunk(item):
            if item is None:  # a completion stream has no opening chunk
                return []
            i, out, new_tokens = item
            c = out.outputs[0]
            logprobs = fmt.completion(out, sent[i], sent[i] + new_tokens, offsets[i]) \
                if fmt else None
            sent[i], offsets[i] = sent[i] + new_tokens, offsets[i] + len(c.delta_text)
            if not (c.delta_text or c.delta_reasoning or c.finish_reason or logprobs):
                return None  # e.g. held back as a possible stop string, or half a character
            choice = {"index": i, "text": c.delta_text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
            if c.delta_reasoning:
                choice.update(reasoning_fields(c.delta_reasoning))
            return {**head, "choices": [choice]}

        def usage_chunk():
            return {**head, "choices": [], "usage": usage(run, req.n)}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(request, run, chunk, usage_chunk, include, headers)
    choices = []
    for i, out in enumerate(await finished_outputs(request, run)):
        c = out.outputs[0]
        logprobs = fmt.completion(out, 0, len(c.token_ids)) if fmt else None
        choices.append({"index": i, "text": c.text, "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        **(reasoning_fields(c.reasoning) if c.reasoning is not None else {})})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": usage(run, req.n)},
                        headers=headers)
