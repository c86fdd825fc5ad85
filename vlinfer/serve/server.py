"""Server: what every route shares, around one EngineLoop (reached as request.app.state.server):
the request's model (or LoRA adapter), task and capacity checks, sequences validated and queued from
a worker thread (generating and pooling ones), prompts for both APIs, and the heap trimmed once a
burst is over."""
import asyncio
import dataclasses

from fastapi import Request

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.lora_request import LoRARequest
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams
from vlinfer.serve import media
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.lora import Adapters
from vlinfer.serve.memory import malloc_trim
from vlinfer.serve.metrics import Metrics
from vlinfer.serve.constraints import forced_tool
from vlinfer.serve.errors import ApiError
from vlinfer.serve.responses import now
from vlinfer.serve.run import Run
from vlinfer.serve.sampling import request_params
from vlinfer.serve.tool_calls import tag_token_ids


class Server:
    def __init__(self, loop: EngineLoop, config: ServeConfig):
        self.loop = loop
        self.engine = loop.engine
        self.config = config
        # this engine serves this app: the server's video caps are its limits
        if self.engine.is_multimodal:
            self.engine.input_processor.mm_processor.videos.limits = config.video
        # --lora-modules read and checked here: ValueError naming one
        self.adapters = Adapters(self.engine, config)
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
        """A burst of image requests leaves the heap full of freed holes (pixel tensors, logits)
        that glibc keeps mapped; malloc_trim returns their pages, so RSS comes back after the burst.
        In a worker thread: ctypes drops the GIL, and it never delays a request that arrives
        meanwhile."""
        self._trim_pending = False
        if self.in_flight == 0:
            asyncio.get_running_loop().run_in_executor(None, malloc_trim)

    # ---- request pieces ----
    def model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The request's model and the adapter it runs: a served model name (or none: the first)
        runs the base model, a LoRA adapter's name that adapter; any other name is a 404 naming it
        (vLLM's)."""
        names = self.config.served_model_names
        if model is None or model in names:
            return model or names[0], None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = [*names, *(name for name, _, _ in self.adapters.cards())]
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return model, adapter

    def check_model(self, model: str | None) -> str:
        """A pooling route's model: a served model name (LoRA adapters answer chat and completions
        only)."""
        name, adapter = self.model(model)
        if adapter is not None:
            raise ApiError(
                400, f"model {name!r} is a LoRA adapter: adapters answer /v1/chat/completions and "
                "/v1/completions", param="model", code="unsupported_task")
        return name

    @property
    def task(self) -> str:
        """What the served model does (/v1/models): "generate", or its pooling task, "embed" or
        "classify"."""
        return self.engine.pooling.task if self.engine.pooling is not None else "generate"

    def check_generates(self) -> None:
        """/v1/chat/completions and /v1/completions: refused up front by a model that cannot
        generate."""
        if not self.engine.can_generate:
            raise ApiError(
                400,
                f"model {self.config.served_model_names[0]!r} is an embedding model without an LM "
                "head: it cannot generate text; it serves /v1/embeddings, /score and /rerank",
                param="model", code="unsupported_task")

    def check_pooling(self, route: str) -> str:
        """The pooling task ("embed" or "classify") that answers `route`; a 400 naming why when none
        does."""
        name, task = self.config.served_model_names[0], self.task
        if task == "generate":
            raise ApiError(
                400,
                f"model {name!r} is a generative model: {route} needs an embedding or a reranker "
                "model (the pooling runner)", param="model", code="unsupported_task")
        if route == "/v1/embeddings" and task != "embed":
            raise ApiError(
                400, f"model {name!r} is a reranker (a classification model): it gives scores "
                "(/score, /rerank), not embeddings", param="model", code="unsupported_task")
        return task

    def pooling_params(self, task: str, dimensions: int | None = None,
                       normalize: bool | None = None,
                       truncate_prompt_tokens: int | None = None) -> PoolingParams:
        """A pooling request's PoolingParams, checked against the model before anything is queued.
        """
        try:
            params = PoolingParams(dimensions=dimensions, normalize=normalize,
                                   truncate_prompt_tokens=truncate_prompt_tokens, task=task)
        except ValueError as e:
            field = str(e).split(" ")[0].removeprefix("PoolingParams.")
            raise ApiError(400,
                           str(e).removeprefix("PoolingParams."), param=field,
                           code="invalid_value") from None
        try:
            self.engine.pooling.check(params, self.config.served_model_names[0])
        except ValueError as e:
            raise ApiError(400, str(e), param="dimensions", code="invalid_value") from None
        return params

    def check_capacity(self, count: int, limit: int | None = None,
                       what: str = "sequences (n x prompts)", param: str = "n") -> None:
        limit = self.config.max_n if limit is None else limit
        if count > limit:
            raise ApiError(400, f"this request asks for {count} {what}; the limit is {limit}",
                           param=param, code="invalid_value")
        self.check_pending(count)

    def check_pending(self, count: int) -> None:
        if self.in_flight + count > self.config.max_pending:
            raise ApiError(503, "the server is at capacity; retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    def sampling_params(self, req, logprobs: int | None) -> SamplingParams:
        tags = tag_token_ids(self.engine.tokenizer) if forced_tool(req) == "*" else (None, None)
        return request_params(req, logprobs, self.engine.max_model_len,
                              self.config.disable_any_whitespace, tags,
                              self.config.max_tokens_default)

    def submit(self, prompts: list, params: SamplingParams, n: int,
               requested_max_tokens: int | None, event_loop,
               lora_request: LoRARequest | None = None, deadline: float | None = None) -> list:
        """In a worker thread: validate every sequence first (so a bad one queues none), then queue
        them all. deadline: the perf_counter time --request-timeout ends them at."""
        seqs = []
        for prompt in prompts:
            # the prompt and its images processed once for its n completions (seed + i each, as
            # LLM.generate)
            try:
                group = self.loop.make_sequences(prompt, dataclasses.replace(params, n=n),
                                                 lora_request)
            except ValueError as e:
                raise ApiError(400, str(e), code="invalid_value") from None
            for seq in group:
                room = self.engine.max_model_len - seq.num_prompt_tokens
                if room < 1 or (requested_max_tokens is not None and requested_max_tokens > room):
                    raise ApiError(
                        400,
                        f"this model's maximum context length is {self.engine.max_model_len} "
                        "tokens; "
                        f"the prompt has {seq.num_prompt_tokens} tokens and max_tokens asks for "
                        f"{requested_max_tokens or 1} more", param="max_tokens",
                        code="context_length_exceeded")
                seq.deadline = deadline
                seqs.append(seq)
        return self._queue(seqs, event_loop)

    def submit_pooling(self, prompts: list, params: PoolingParams, names: list[str],
                       event_loop) -> list:
        """In a worker thread: one pooling sequence per prompt, all validated first (a bad one,
        named by its entry of `names`, queues none), then queued."""
        seqs = []
        for prompt, name in zip(prompts, names, strict=True):
            try:
                seqs.extend(self.loop.make_sequences(prompt, params))
            except ValueError as e:
                raise ApiError(400, f"{name}: {e}", param=name, code="invalid_value") from None
        return self._queue(seqs, event_loop)

    def _queue(self, seqs: list, event_loop) -> list:
        try:
            return self.loop.submit_sequences(seqs, event_loop)
        except RuntimeError:
            raise ApiError(503, "the engine is not running", code="engine_dead") from None

    async def in_thread(self, fn):
        """Run fn in a worker thread. If this request is cancelled meanwhile, the thread still
        completes: any streams it queued are aborted when it does, so nothing is left generating for
        nobody."""
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

    async def start(self, request: Request, prompts_fn, params: SamplingParams, n: int,
                    num_prompts: int, requested_max_tokens: int | None,
                    lora_request: LoRARequest | None = None) -> Run:
        self.check_capacity(n * num_prompts)
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else request.state.arrival + timeout
        return await self._start(
            request, n * num_prompts, lambda event_loop: self.submit(prompts_fn(
            ), params, n, requested_max_tokens, event_loop, lora_request, deadline))

    async def start_pooling(self, request: Request, prompts_fn, params: PoolingParams,
                            names: list[str]) -> Run:
        """Queue one pooling sequence per prompt of prompts_fn() (built in the worker thread;
        `names` says which field of the request each comes from); the caller checked the request's
        size."""
        self.check_pending(len(names))
        return await self._start(
            request, len(names),
            lambda event_loop: self.submit_pooling(prompts_fn(), params, names, event_loop))

    async def _start(self, request: Request, count: int, submit_fn) -> Run:
        """submit_fn(event_loop) in a worker thread: it builds, validates and queues `count`
        sequences."""
        event_loop = asyncio.get_running_loop()

        def work():
            return submit_fn(event_loop)

        # reserved while it is prepared, so concurrent requests count it already
        self.in_flight += count
        try:
            streams = await self.in_thread(work)
        except BaseException:
            self.in_flight -= count
            raise
        return Run(self, streams, request.state.arrival)

    def chat_prompt(self, messages, sources, fetched, mm_processor_kwargs: dict | None, tools=None,
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> dict:
        """In a worker thread: a request's messages (images decoded, videos read) through the chat
        template, with the server's default template variables under the request's own."""
        from jinja2.exceptions import TemplateError

        from vlinfer.multimodal.chat import ToolsNotRenderedError
        images = media.load_images(sources, fetched, self.config.images)
        messages = media.chat_messages(messages, images, self.config.images, fetched)
        tools = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        variables = {**(self.config.default_chat_template_kwargs or {}),
                     **(chat_template_kwargs or {})}
        try:
            return self.engine.chat_prompt(messages, add_generation_prompt,
                                           chat_template=self.config.chat_template,
                                           mm_processor_kwargs=mm_processor_kwargs, tools=tools,
                                           chat_template_kwargs=variables)
        except ToolsNotRenderedError as e:  # the remedy is the server's flag, not a Python keyword
            raise ApiError(
                400, f"the chat template of model {e.model_name!r} does not render tools, so the "
                "model would never see them: send the request without tools, or start the server "
                "with --chat-template FILE, a template that reads `tools` (the model family's "
                "tool-calling template)", param="tools", code="invalid_value") from None
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        # the template refuses this conversation (e.g. a system message not first)
        except TemplateError as e:
            raise ApiError(400, f"the chat template cannot render these messages: {e}",
                           param="messages", code="invalid_value") from None

    def completion_prompts(self, prompt, param: str = "prompt") -> list:
        """A text or token-id prompt, or a list of them (/v1/completions' prompt, /v1/embeddings'
        input)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ApiError(400, f"{param} is empty", param=param)
        processor = self.engine.input_processor.mm_processor
        for prompt in prompts:
            if processor is None:
                continue
            # Raw prompts may hold any chat token, but vision placeholders only come from real
            # images.
            if isinstance(prompt, str):
                try:
                    processor.check_user_text(prompt)
                except ValueError as e:
                    raise ApiError(400, str(e), param=param) from None
            elif processor.special_ids.intersection(prompt):
                raise ApiError(
                    400, f"{param} token ids contain vision token ids; this field takes no images",
                    param=param)
        return prompts
