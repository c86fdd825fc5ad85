"""The server's request handling around one EngineLoop: model and capacity checks, sequences validated and
queued from a worker thread, prompts for both APIs, and the heap trimmed once a burst is over."""
import asyncio
import dataclasses

from fastapi import Request

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.sampling_params import SamplingParams
from vlinfer.serve import media
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.memory import malloc_trim
from vlinfer.serve.metrics import Metrics
from vlinfer.serve.protocol import ApiError, ChatCompletionRequest, now
from vlinfer.serve.run import Run
from vlinfer.serve.constraints import forced_tool
from vlinfer.serve.sampling import request_params
from vlinfer.serve.tool_calls import tag_token_ids


class Server:
    def __init__(self, loop: EngineLoop, config: ServeConfig):
        self.loop = loop
        self.engine = loop.engine
        self.config = config
        if self.engine.is_multimodal:  # this engine serves this app: the server's video caps are its limits
            self.engine.input_processor.mm_processor.videos.limits = config.video
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
        tags = tag_token_ids(self.engine.tokenizer) if forced_tool(req) == "*" else (None, None)
        return request_params(req, logprobs, self.engine.max_model_len, self.config.disable_any_whitespace, tags)

    def submit(self, prompts: list, params: SamplingParams, n: int, requested_max_tokens: int | None,
               event_loop) -> list:
        """In a worker thread: validate every sequence first (so a bad one queues none), then queue them all."""
        seqs = []
        for prompt in prompts:
            try:  # the prompt and its images processed once for its n completions (seed + i each, as LLM.generate)
                group = self.loop.make_sequences(prompt, dataclasses.replace(params, n=n))
            except ValueError as e:
                raise ApiError(400, str(e), code="invalid_value") from None
            for seq in group:
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
                    requested_max_tokens: int | None) -> Run:
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
        return Run(self, streams, request.state.arrival)

    def chat_prompt(self, req: ChatCompletionRequest, sources, fetched) -> dict:
        from jinja2.exceptions import TemplateError
        images = media.load_images(sources, fetched, self.config.images)
        messages = media.chat_messages(req.messages, images, self.config.images, fetched)
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
        processor = self.engine.input_processor.mm_processor
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
