"""OpenAI-compatible HTTP server: one engine in one EngineLoop, every connection's requests in the same batch.

A request goes: GuardMiddleware (API key, body cap) -> parse (strict pydantic) -> image URLs fetched on the event
loop (async, capped) -> a worker thread decodes images, applies the chat template, validates and queues the
sequences (queueing never waits for an engine step) -> outputs come back through AsyncRequestStream
(call_soon_threadsafe, no thread per request) -> JSON or SSE. A client that goes away has its sequences aborted,
which frees their KV blocks and encoder cache entries at once."""
import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.sampling_params import SamplingParams
from vlinfer.serve import security
from vlinfer.serve.constraints import forced_tool, output_constraint
from vlinfer.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vlinfer.serve.metrics import Metrics
from vlinfer.serve.protocol import (MAX_STOP_SEQUENCES, ApiError, ChatCompletionRequest, CompletionRequest, Logprobs,
                                    error_body, new_id, now, parse_body, sse, usage)
from vlinfer.serve.tool_calls import ToolCallParser, parse_tool_calls
from vlinfer.multimodal.video_io import VideoLimits
from vlinfer.multimodal.video_processor import VIDEO_OPTIONS
from vlinfer.serve.video import check_video_options, video_bytes

logger = logging.getLogger("vlinfer.serve")


@dataclass
class ServeConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 32 * 2 ** 20
    images: security.ImagePolicy = field(default_factory=security.ImagePolicy)
    max_n: int = 16  # choices per request (n) times prompts per /v1/completions request
    max_pending: int = 1024  # sequences queued or running before new requests get 503
    trim_memory_when_idle: bool = True  # hand freed heap pages back to the OS once a burst is over (glibc)
    # vLLM's structured-outputs option: JSON the server constrains has no free whitespace (a request's own
    # structured_outputs.disable_any_whitespace wins). Small models otherwise pad JSON with newlines.
    disable_any_whitespace: bool = False
    # What one video may cost (frames sampled, seconds, frame size): the engine's video limits while it serves
    # this app (--max-video-frames, --max-video-seconds).
    video: VideoLimits = field(default_factory=lambda: VideoLimits(max_frames=768, max_seconds=3600.0))


def _sampling_error(e: ValueError) -> ApiError:
    text = str(e)
    m = re.match(r"SamplingParams\.(\w+) ", text)
    return ApiError(400, text.replace("SamplingParams.", ""), param=m.group(1) if m else None, code="invalid_value")


class _Run:
    """The sequences of one HTTP request (n choices, maybe several prompts): their outputs merged in arrival
    order, the server's metrics, and abort of whatever is unfinished when the request ends early."""

    def __init__(self, server: "Server", streams: list, arrival: float):
        self.server, self.streams, self.arrival = server, streams, arrival
        self.last = [None] * len(streams)  # latest RequestOutput per choice
        self.first_token_at = [None] * len(streams)
        self.done = [False] * len(streams)
        self.closed = False

    async def outputs(self):
        """Yields (index, RequestOutput, number of new tokens) until every sequence finished."""
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
        new_tokens = len(out.outputs[0].token_ids) - (len(previous.outputs[0].token_ids) if previous else 0)
        self.last[i] = out
        if self.first_token_at[i] is None and out.outputs[0].token_ids:
            self.first_token_at[i] = t
            self.server.metrics.ttft.observe(t - self.arrival)
        if out.finished:
            self._finish(i, out.outputs[0].finish_reason or "abort", t)
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
        n = len(out.outputs[0].token_ids)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.cached_tokens.inc(out.num_cached_tokens)
        m.generation_tokens.inc(n)
        if reason == "abort":  # cut short: its latencies would describe the client, not the server
            return
        m.e2e.observe(t - self.arrival)
        if n > 1 and self.first_token_at[i] is not None:
            m.tpot.observe((t - self.first_token_at[i]) / (n - 1))

    def close(self) -> None:
        """Abort what has not finished (client gone, error). An abort never waits for a step: it runs here, on
        the event loop."""
        if self.closed:
            return
        self.closed = True
        t = time.perf_counter()
        for i, stream in enumerate(self.streams):
            if not self.done[i]:
                stream.abort()
                self._finish(i, "abort", t)


class Server:
    def __init__(self, loop: EngineLoop, config: ServeConfig):
        self.loop = loop
        self.engine = loop.engine
        self.config = config
        if self.engine.is_multimodal:  # this engine serves this app: the server's video caps are its limits
            self.engine.input_processor.videos.limits = config.video
        self.metrics = Metrics(loop, lambda: self.in_flight)
        self.in_flight = 0
        self.created = now()
        self._trim_pending = False

    # ---- memory ----
    IDLE_TRIM_DELAY_S = 1.0

    def sequence_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.config.trim_memory_when_idle and not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(self.IDLE_TRIM_DELAY_S, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        """A burst of image requests leaves the heap full of freed holes (pixel tensors, logits) that glibc
        keeps mapped; malloc_trim returns their pages, so RSS comes back after the burst. In a worker thread:
        ctypes drops the GIL, and it never delays a request that arrives meanwhile."""
        self._trim_pending = False
        if self.in_flight == 0:
            asyncio.get_running_loop().run_in_executor(None, malloc_trim)

    # ---- request pieces ----
    def check_model(self, model: str | None) -> str:
        names = self.config.served_model_names
        if model is not None and model not in names:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {list(names)}",
                           param="model", code="model_not_found")
        return model or names[0]

    def check_capacity(self, count: int) -> None:
        if count > self.config.max_n:
            raise ApiError(400, f"this request asks for {count} sequences (n x prompts); the limit is "
                                f"{self.config.max_n}", param="n", code="invalid_value")
        if self.in_flight + count > self.config.max_pending:
            raise ApiError(503, "the server is at capacity; retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    def sampling_params(self, req, logprobs: int | None) -> SamplingParams:
        # Unset fields keep SamplingParams' (vLLM's) defaults; set ones are checked there, once, for both APIs.
        options = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                       presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                       repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                       stop_token_ids=req.stop_token_ids, seed=req.seed, logprobs=logprobs,
                       skip_special_tokens=req.skip_special_tokens,
                       spaces_between_special_tokens=req.spaces_between_special_tokens,
                       include_stop_str_in_output=req.include_stop_str_in_output,
                       truncate_prompt_tokens=req.truncate_prompt_tokens, logit_bias=req.logit_bias,
                       allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                       structured_outputs=output_constraint(req, self.config.disable_any_whitespace))
        options = {k: v for k, v in options.items() if v is not None}
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_SEQUENCES:
            raise ApiError(400, f"stop has {len(req.stop)} sequences; the limit is {MAX_STOP_SEQUENCES}",
                           param="stop")
        if req.stop:
            options["stop"] = req.stop
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        # Unset: the room left in the context; the engine stops there with finish_reason "length" either way.
        options["max_tokens"] = max_tokens or self.engine.max_model_len
        try:
            return SamplingParams(**options)
        except ValueError as e:
            raise _sampling_error(e) from None

    def check_mm_kwargs(self, kwargs: dict | None) -> None:
        """Image sizes (min_pixels, max_pixels) and the video keys (fps, num_frames, ...; serve/video.py), each
        checked here so a bad value is a 400 naming it before anything is decoded."""
        video = {}
        for key, value in (kwargs or {}).items():
            if key in VIDEO_OPTIONS:
                video[key] = value
                continue
            if key not in ("min_pixels", "max_pixels"):
                raise ApiError(400, f"unknown mm_processor_kwargs key {key!r}; accepted: min_pixels, max_pixels, "
                                    f"{', '.join(VIDEO_OPTIONS)}", param="mm_processor_kwargs")
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not 1 <= value <= self.config.images.max_image_pixels:
                raise ApiError(400, f"mm_processor_kwargs.{key} must be an integer in "
                                    f"[1, {self.config.images.max_image_pixels}]", param="mm_processor_kwargs")
        if video:
            check_video_options(video, self.engine, self.config.video)

    def submit(self, prompts: list, params: SamplingParams, n: int, requested_max_tokens: int | None,
               event_loop) -> list:
        """In a worker thread: validate every sequence first (so a bad one queues none), then queue them all."""
        seqs = []
        for prompt in prompts:
            for i in range(n):
                p = params.for_completion(i)  # seed + i when seeded, as LLM.generate runs n completions
                try:
                    seq = self.loop.make_sequence(prompt, p)
                except ValueError as e:
                    raise ApiError(400, str(e), code="invalid_value") from None
                room = self.engine.max_model_len - seq.num_prompt_tokens
                if room < 1 or (requested_max_tokens is not None and requested_max_tokens > room):
                    raise ApiError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                                        f"the prompt has {seq.num_prompt_tokens} tokens and max_tokens asks for "
                                        f"{requested_max_tokens or 1} more", param="max_tokens",
                                   code="context_length_exceeded")
                seqs.append(seq)
        try:
            return self.loop.submit_sequences(seqs, event_loop)
        except RuntimeError:
            raise ApiError(503, "the engine is not running", code="engine_dead") from None

    async def in_thread(self, fn):
        """Run fn in a worker thread. If this request is cancelled meanwhile, the thread still completes: any
        streams it queued are aborted when it does, so nothing is left generating for nobody."""
        task = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def abort(t):
                if not t.cancelled() and t.exception() is None and isinstance(t.result(), list):
                    for stream in t.result():
                        stream.abort()
            task.add_done_callback(abort)
            raise

    async def start(self, request: Request, prompts_fn, params: SamplingParams, n: int, num_prompts: int,
                    requested_max_tokens: int | None) -> _Run:
        count = n * num_prompts
        self.check_capacity(count)
        event_loop = asyncio.get_running_loop()

        def work():
            return self.submit(prompts_fn(), params, n, requested_max_tokens, event_loop)

        self.in_flight += count  # reserved while it is prepared, so concurrent requests count it already
        try:
            streams = await self.in_thread(work)
        except BaseException:
            self.in_flight -= count
            raise
        return _Run(self, streams, request.state.arrival)

    # ---- images ----
    def image_sources(self, messages) -> list[tuple[str, str]]:
        """(url, param) of every image part, in order; refuses a text-only model and too many images early."""
        sources = []
        for i, message in enumerate(messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type == "image_url":
                        sources.append((part.image_url.url, f"messages.{i}.content.{j}.image_url.url"))
        if sources and not self.engine.is_multimodal:
            raise ApiError(400, f"model {self.config.served_model_names[0]!r} is a text-only model and does not "
                                "accept images", param=sources[0][1])
        limit = self.config.images.max_images
        if len(sources) > limit:
            raise ApiError(400, f"the request has {len(sources)} images; the limit is {limit} per request",
                           param="messages", code="too_many_images")
        for url, param in sources:
            if security.image_kind(url) == "other":
                raise security.unsupported_source(url, param)
        return sources

    async def fetch_urls(self, sources) -> dict[int, bytes]:
        """http(s) images, fetched concurrently on the event loop (no thread waits on a slow server)."""
        jobs = {i: security.fetch_url(url, self.config.images, param)
                for i, (url, param) in enumerate(sources) if security.image_kind(url) == "http"}
        results = await asyncio.gather(*jobs.values())
        return dict(zip(jobs, results))

    def load_images(self, sources, fetched: dict[int, bytes]) -> list:
        """In a worker thread: every source to a decoded PIL image (data URIs and files read here)."""
        policy, images = self.config.images, []
        for i, (url, param) in enumerate(sources):
            kind = security.image_kind(url)
            if kind == "data":
                data = security.decode_data_uri(url, policy, param)
            elif kind == "file":
                data = security.read_local_file(url, policy, param)
            else:
                data = fetched[i]
            images.append(security.decode_image(data, policy, param))
        return images

    def chat_prompt(self, req: ChatCompletionRequest, sources, fetched) -> dict:
        from jinja2.exceptions import TemplateError
        images = iter(self.load_images(sources, fetched))
        messages = []
        for i, message in enumerate(req.messages):
            role = "system" if message.role == "developer" else message.role
            if isinstance(message.content, list):
                content = [{"type": "text", "text": part.text} if part.type == "text"
                           else {"type": "video", "video": video_bytes(part.video_url.url, self.config.images,
                                                                        f"messages.{i}.content.{j}.video_url.url")}
                           if part.type == "video_url"
                           else {"type": "image", "image": next(images), "detail": part.image_url.detail}
                           for j, part in enumerate(message.content)]
            else:
                content = message.content or ""
            entry = {"role": role, "content": content}
            if message.tool_calls:  # an earlier answer's calls, written back by the template in its own format
                entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            messages.append(entry)
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        try:
            return self.engine.chat_prompt(messages, mm_processor_kwargs=req.mm_processor_kwargs, tools=tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        except TemplateError as e:  # the template refuses this conversation (e.g. a system message not first)
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="invalid_value") from None

    def completion_prompts(self, prompt) -> list:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt")
        processor = self.engine.input_processor
        for prompt in prompts:
            if processor is None:
                continue
            # Raw prompts may hold any chat token, but vision placeholders only come from real images.
            if isinstance(prompt, str):
                try:
                    processor.check_user_text(prompt)
                except ValueError as e:
                    raise ApiError(400, str(e), param="prompt") from None
            elif processor.special_ids.intersection(prompt):
                raise ApiError(400, "prompt token ids contain vision token ids; this endpoint takes no images",
                               param="prompt")
        return prompts


# ---- responses ----
def _choice_logprobs(fmt: Logprobs | None, out, start: int, end: int, chat: bool, text_offset: int = 0):
    """Logprobs of output tokens [start, end). Index by count, not by taking the list whole: the engine shares
    one growing list with every output of a request, and its loop thread may have appended past `out` already."""
    if fmt is None:
        return None
    token_ids = out.outputs[0].token_ids[start:end]
    entries = out.outputs[0].logprobs[start:end]
    return fmt.chat(token_ids, entries) if chat else fmt.completion(token_ids, entries, text_offset)


def _usage(run: _Run, n: int) -> dict:
    """Each prompt counted once (as OpenAI does for n > 1), its cached tokens from its first sequence."""
    firsts = [out for i, out in enumerate(run.last) if i % n == 0 and out is not None]
    completion = sum(len(out.outputs[0].token_ids) for out in run.last if out is not None)
    return usage(sum(len(o.prompt_token_ids) for o in firsts), completion, sum(o.num_cached_tokens for o in firsts))


async def _watch_disconnect(request: Request, run: _Run) -> None:
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


async def _stream(request: Request, run: _Run, chunk_fn, usage_chunk_fn, include_usage: bool):
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


async def _collect(request: Request, run: _Run) -> None:
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        async for _ in run.outputs():
            pass
    finally:
        watcher.cancel()
        run.close()


async def _respond(request: Request, run: _Run, req, model: str, chat: bool, fmt: Logprobs | None) -> Response:
    """The response of a started run, in the chat or the text completion shape, streamed (SSE) or whole."""
    request_id, created = new_id("chatcmpl" if chat else "cmpl"), now()
    kind = "chat.completion" if chat else "text_completion"
    headers = {"X-Request-Id": request_id}
    count = len(run.streams)
    tools = _tool_mode(req) if chat else None
    if req.stream:
        head = {"id": request_id, "object": kind + (".chunk" if chat else ""), "created": created, "model": model}
        sent, offsets = [0] * count, [0] * count  # per choice: tokens whose logprobs went out, text length
        parsers = [ToolCallParser(bare=tools == "bare") for _ in range(count)] if tools else None

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
    await _collect(request, run)
    _check_complete(run)
    choices = []
    for i, out in enumerate(run.last):
        c = out.outputs[0]
        finish = c.finish_reason
        if not chat:
            body = {"text": c.text}
        elif tools:
            content, calls = parse_tool_calls(c.text, bare=tools == "bare")
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
    "auto" (<tool_call> blocks anywhere in the text) or "bare" (a forced call: the constrained text is the call
    object itself)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return "bare" if forced_tool(req) else "auto"


def _finish_reason(reason: str | None, calls: list) -> str | None:
    """An answer that ended by itself after calling tools finished to have them run (OpenAI's "tool_calls"); one
    cut by max_tokens keeps "length", so a truncated call is never mistaken for a complete one."""
    return "tool_calls" if calls and reason == "stop" else reason


def _check_complete(run: _Run) -> None:
    if any(out is None or not out.finished for out in run.last):
        # Only reached when the client went away (nobody reads this) or a sequence was aborted under it.
        raise ApiError(499, "the request was aborted before it finished", code="aborted")


def _json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                       code="unsupported_media_type")


def build_app(loop: EngineLoop, config: ServeConfig) -> FastAPI:
    server = Server(loop, config)
    engine = server.engine
    app = FastAPI(title="vlinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    # ---- errors: always the OpenAI shape, never a stack trace ----
    def error(status: int, message: str, param=None, code=None, type=None, headers=None) -> Response:
        return Response(error_body(status, message, param, code, type), status_code=status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {loc}: {first.get('msg', 'invalid')}", loc or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path!r}"}.get(e.status_code, str(e.detail))
        return error(e.status_code, message, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code),
                     headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        return error(500, "internal server error; see the server log", code="internal_error")

    # ---- routes ----
    @app.get("/health")
    async def health():
        if not loop.is_alive():
            return error(503, "the engine loop is not running", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created,
                                            "owned_by": "vlinfer", "max_model_len": engine.max_model_len}
                                           for name in config.served_model_names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _json_content_type(request)
        req = parse_body(ChatCompletionRequest, await request.body())
        model = server.check_model(req.model)
        server.check_mm_kwargs(req.mm_processor_kwargs)
        fmt = Logprobs(engine.tokenizer, req.top_logprobs or 0) if req.logprobs else None
        params = server.sampling_params(req, (req.top_logprobs or 0) if req.logprobs else None)
        server.check_capacity(req.n)
        sources = server.image_sources(req.messages)
        fetched = await server.fetch_urls(sources)
        run = await server.start(request, lambda: [server.chat_prompt(req, sources, fetched)], params, req.n, 1,
                                 req.max_completion_tokens or req.max_tokens)
        return await _respond(request, run, req, model, chat=True, fmt=fmt)

    @app.post("/v1/completions")
    async def completions(request: Request):
        _json_content_type(request)
        req = parse_body(CompletionRequest, await request.body())
        model = server.check_model(req.model)
        fmt = Logprobs(engine.tokenizer, req.logprobs) if req.logprobs is not None else None
        params = server.sampling_params(req, req.logprobs)
        prompts = server.completion_prompts(req.prompt)
        server.check_capacity(req.n * len(prompts))
        run = await server.start(request, lambda: prompts, params, req.n, len(prompts), req.max_tokens)
        return await _respond(request, run, req, model, chat=False, fmt=fmt)

    # Outermost: runs before routing, so unauthenticated or oversized requests cost no parsing.
    app.add_middleware(security.GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_response=server.metrics.on_response)
    return app


# ---- memory (glibc) ----
def malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def limit_malloc_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas (default: 8 per core). Each thread that decodes images or runs the engine gets an
    arena, and after a burst of large transient tensors (pixel values, logits) the free space stays fragmented
    across them, where even malloc_trim cannot return it: measured on the tiny model, +12% RSS after the first
    64-image burst with the default arenas, +2% with 2. Must run before the process has made 8 arenas;
    MALLOC_ARENA_MAX in the environment wins. Returns whether it was applied."""
    if n <= 0 or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").mallopt(-8, n))  # -8: M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        return False
