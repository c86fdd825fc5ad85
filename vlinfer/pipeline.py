"""`Pipeline("qwen3-vl")`: images and text in, text out. A thin layer over LLM for the common cases.
"""
import os
from collections.abc import Iterable, Iterator

from vlinfer.caption_records import make_record
from vlinfer.config import ANSWER_MAX_TOKENS, DESCRIBE_IMAGE_PROMPT, DESCRIBE_VIDEO_PROMPT
from vlinfer.engine.drive import drive
from vlinfer.inputs.limits import text_only
from vlinfer.inputs.retrieval import embedding_messages, mm_processor_kwargs
from vlinfer.llm import LLM, clamp_cosine
from vlinfer.lora_request import LoRARequest
from vlinfer.multimodal.media_paths import IMAGE_EXTENSIONS, collect_images
from vlinfer.outputs import ChatAnswer, RequestError
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams

# transformers' pipeline task names that mean what a Pipeline does: Pipeline("image-to-text",
# model=...) is taken as transformers' pipeline(...) is; the model decides what it can do.
TASKS = ("image-text-to-text", "image-to-text", "visual-question-answering", "text-generation",
         "feature-extraction", "image-feature-extraction", "text-ranking")
# image-size keywords taken beside the sampling ones, as mm_processor_kwargs entries
MEDIA_KEYWORDS = ("min_pixels", "max_pixels")


class CaptionError(RequestError):
    """Pipeline.caption: some images could not be captioned; every other one was. `.captions`
    holds the captions in input order (None for each failure), `.failures` (image, error) pairs,
    `.outputs` the RequestOutputs (RequestError's)."""

    def __init__(self, outputs: list, names: list[str]):
        super().__init__(outputs)
        self.failures = [(name, out.error) for name, out in zip(names, outputs) if out.error]
        self.captions = [None if out.error else out.outputs[0].text for out in outputs]
        self.args = (f"{len(self.failures)} of {len(outputs)} images could not be captioned; the "
                     "others were (their captions are in this error's .captions, or pass "
                     "errors='record' for one record per image with its error in place): " +
                     "; ".join(f"{name}: {error}" for name, error in self.failures),)


class Pipeline:
    """Images and text in, text out, over one model:

        pipe = Pipeline("qwen3-vl")          # or Pipeline("image-to-text", model="qwen3-vl")
        pipe("cat.jpg")                      # "Describe this image." of it
        pipe("cat.jpg", "What colour is it?")  # image first, then the prompt
        pipe("What is a house?")             # a first argument that is no image is the prompt
        pipe.chat(messages); pipe.stream(...)  # text deltas as they come
        pipe.caption("photos/")              # a folder, a glob, a list of paths or images

    Sampling options (temperature, top_p, max_tokens, seed, n, ...) pass through as keyword
    arguments (n > 1 returns a list of n answers), and so do min_pixels / max_pixels (the images'
    size budget); the rest of **engine_options go to LLM, vLLM's keywords included. lora=PATH: a
    PEFT LoRA adapter folder every request runs with (LoRARequest.from_path: named after its
    folder; enable_lora is set for it, max_lora_rank must hold its rank); it is read and checked
    here, so a bad one fails now, named."""

    def __init__(self, task: str | None = None, model: str | None = None, *,
                 lora: str | None = None, **engine_options):
        """Pipeline(model) or, as transformers' pipelines, Pipeline(task, model=...) with one of
        TASKS (the model decides what it can do); no model: "qwen3-vl"."""
        if task is not None and task not in TASKS:
            if model is not None:
                raise ValueError(f"Pipeline({task!r}, model={model!r}): {task!r} is not a task "
                                 f"({', '.join(TASKS)}); give the model once")
            task, model = None, task
        model = model or "qwen3-vl"
        self.task = task
        self.lora_request = LoRARequest.from_path(lora) if lora is not None else None
        if self.lora_request is not None:
            if engine_options.get("enable_lora") is False:
                raise ValueError(
                    "Pipeline(lora=...) runs an adapter: it needs enable_lora, not "
                    "enable_lora=False"
                )
            engine_options["enable_lora"] = True
        self.llm = LLM(model, **engine_options)
        self.engine = self.llm.engine
        self.model = model
        self.is_multimodal = self.engine.is_multimodal
        if self.lora_request is not None:
            try:
                if not self.engine.can_generate or self.engine.pooling is not None:
                    raise ValueError(
                        f"Pipeline(lora=...): model {model!r} is a pooling model (embeddings, "
                        "scores); "
                        "LoRA adapters run on generating models")
                self.engine.input_processor.check_lora(self.lora_request)
            except ValueError:
                self.llm.close()
                raise

    @property
    def device(self) -> str:
        return str(self.engine.device)

    @property
    def embedded(self) -> bool:
        """True when running an embedded model (the toy, or the random-weight one):
        engine.source.about says what its answers are worth."""
        return self.engine.source.embedded

    @property
    def default_max_tokens(self) -> int:
        """max_tokens when none is given: room for a full answer, or on an embedded toy its world's
        longest answer (a picture outside that world then cannot loop for hundreds of tokens)."""
        return self.engine.source.max_tokens or ANSWER_MAX_TOKENS

    @staticmethod
    def sampling_params(sampling_params: SamplingParams | None = None, *,
                        default_max_tokens: int = ANSWER_MAX_TOKENS, **options) -> SamplingParams:
        if sampling_params is not None:
            if options:
                raise ValueError(
                    "pass either sampling_params or sampling keyword options, not both")
            return sampling_params
        # SamplingParams' 16 would cut most answers short
        options.setdefault("max_tokens", default_max_tokens)
        return SamplingParams(**options)

    def messages(self, prompt: str | None = None, images: Iterable | None = None,
                 videos: Iterable | None = None) -> list[dict]:
        """One user turn: the images and videos first, then the text (the layout Qwen3-VL was
        trained on)."""
        images, videos = list(images or []), list(videos or [])
        if (images or videos) and not self.is_multimodal:
            raise ValueError(text_only(self.model, "images" if images else "videos",
                                       self.engine.input_processor.language_model_only))
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        parts = [{"type": "image", "image": image} for image in images] + \
            [{"type": "video", "video": video} for video in videos]
        if prompt:
            parts.append({"type": "text", "text": prompt})
        if not parts:
            raise ValueError("nothing to answer: give a prompt, an image, or both")
        return [{"role": "user", "content": parts}]

    def user_turn(self, image=None, prompt: str | None = None, images: Iterable | None = None,
                  video=None, videos: Iterable | None = None) -> list[dict]:
        """The conversation of pipe(image, prompt, ...): a first argument that is a string but no
        image source (no such file, no URL, no data URI, no image file name) is the prompt when no
        prompt is given; images or videos without a prompt are described."""
        if isinstance(image, str) and prompt is None and (not self.is_multimodal or
                                                          not is_image_source(image)):
            image, prompt = None, image
        elif self.is_multimodal and isinstance(image, (str, os.PathLike)) and \
                not is_image_source(image):
            raise ValueError(
                    f"{os.fspath(image)!r} is not an image: no such file, and not a URL or data "
                    "URI; to ask without an image, pass the question alone or as prompt=...")
        images = ([image] if image is not None else []) + list(images or [])
        videos = ([video] if video is not None else []) + list(videos or [])
        if prompt is None and (images or videos):
            prompt = DESCRIBE_IMAGE_PROMPT if images else DESCRIBE_VIDEO_PROMPT
        return self.messages(prompt, images, videos)

    def __call__(self, image=None, prompt: str | None = None, *, images: Iterable | None = None,
                 video=None, videos: Iterable | None = None,
                 sampling_params: SamplingParams | None = None,
                 mm_processor_kwargs: dict | None = None, thinking: bool | None = None,
                 **sampling) -> str | list[str]:
        """pipe(image, prompt) -> the answer: pipe(image) describes it, pipe(question) asks
        without an image (user_turn says how the first argument is read). image: a path, URL,
        data URI, bytes, PIL image or tensor; images=[...] for several. video / videos: a path,
        bytes, data URI, frames (or (frames, metadata)); mm_processor_kwargs takes fps,
        num_frames, max_frames, video_max_pixels ... for them, and min_pixels / max_pixels for
        images (also keywords here). n > 1: a list of n answers. thinking: as in chat."""
        return self.chat(self.user_turn(image, prompt, images, video, videos), sampling_params,
                         mm_processor_kwargs, thinking=thinking, **sampling)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             mm_processor_kwargs: dict | None = None, thinking: bool | None = None,
             detailed: bool = False, **sampling) -> str | list[str] | ChatAnswer | list[ChatAnswer]:
        """The answer to a conversation (OpenAI-style messages); n > 1: a list of n answers.
        mm_processor_kwargs: {"min_pixels": ..., "max_pixels": ...} for this request's images
        (min_pixels= / max_pixels= keywords too). A thinking model's answer is the text after its
        thinking; thinking=False asks it not to think (the template's enable_thinking), None leaves
        the template's default. detailed=True: ChatAnswer(s), with the thinking in `.reasoning`."""
        mm_processor_kwargs = media_options(mm_processor_kwargs, sampling)
        params = self.sampling_params(sampling_params, default_max_tokens=self.default_max_tokens,
                                      **sampling)
        outputs = self.llm.chat(messages, params, use_tqdm=False,
                                mm_processor_kwargs=mm_processor_kwargs,
                                lora_request=self.lora_request,
                                chat_template_kwargs=thinking_kwargs(thinking))[0].outputs
        answers = [ChatAnswer(out.text, out.reasoning, out.finish_reason, out.token_ids)
                   for out in outputs] if detailed else [out.text for out in outputs]
        return answers[0] if params.n == 1 else answers

    def stream(self, image=None, prompt: str | None = None, *, images: Iterable | None = None,
               messages: list[dict] | None = None, sampling_params: SamplingParams | None = None,
               mm_processor_kwargs: dict | None = None, thinking: bool | None = None,
               **sampling) -> Iterator[str] | Iterator[tuple[int, str]]:
        """Yield text deltas as tokens arrive (never half a multi-byte character); the arguments
        are read as __call__ reads them, or messages=... With n > 1, (index, delta) pairs instead,
        so each completion's text stays apart; the stream ends when all n have finished. Closing
        the generator early aborts the request and frees its blocks. A thinking model's thinking
        is not in the deltas (thinking as in chat)."""
        if messages is None:
            messages = self.user_turn(image, prompt, images)
        mm_processor_kwargs = media_options(mm_processor_kwargs, sampling)
        params = self.sampling_params(sampling_params, default_max_tokens=self.default_max_tokens,
                                      **sampling)
        prompt_dict = self.engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs,
                                              chat_template_kwargs=thinking_kwargs(thinking))
        request_id = self.engine.add_request(prompt_dict, params, lora_request=self.lora_request)
        for out in drive(self.engine, [request_id]):  # closed early: drive aborts the request
            delta, index = out.outputs[0].delta_text, out.outputs[0].index
            if delta:
                yield delta if params.n == 1 else (index, delta)

    def caption(self, images, prompt: str = DESCRIBE_IMAGE_PROMPT, batch_size: int = 8,
                sampling_params: SamplingParams | None = None,
                mm_processor_kwargs: dict | None = None, errors: str = "raise",
                **sampling) -> list[str] | list[dict]:
        """Captions in input order. images: a folder (its image files, sorted), a glob, a .txt list
        of paths or one path, as `vlinfer caption` reads them; or a list of paths (each expanded
        so), URLs, data URIs, bytes, PIL images or tensors; one image alone is one caption.
        errors="raise": an image that cannot be read raises CaptionError after every other one is
        captioned, naming each failure (the captions are in its .captions); errors="record": one
        record per image, `vlinfer caption`'s (path, caption, tokens, size, num_image_tokens,
        error), a failure's error in its place."""
        if errors not in ("raise", "record"):
            raise ValueError(f"errors must be 'raise' or 'record', got {errors!r}")
        if not self.is_multimodal:
            raise ValueError(text_only(self.model, "images",
                                       self.engine.input_processor.language_model_only))
        mm_processor_kwargs = media_options(mm_processor_kwargs, sampling)
        params = self.sampling_params(sampling_params, default_max_tokens=self.default_max_tokens,
                                      **sampling)
        images = caption_inputs(images)
        names = [image if isinstance(image, str) and not image.startswith("data:") else
                 f"images[{i}]" for i, image in enumerate(images)]
        outputs = []
        for start in range(0, len(images), batch_size):
            batch = [self.messages(prompt, [image]) for image in images[start:start + batch_size]]
            try:
                outputs.extend(self.llm.chat(batch, params, use_tqdm=False,
                                             mm_processor_kwargs=mm_processor_kwargs,
                                             lora_request=self.lora_request))
            except RequestError as e:  # the rest of the batch ran; the next batches still run
                outputs.extend(e.outputs)
        if errors == "record":
            return [make_record(name, out) for name, out in zip(names, outputs)]
        if any(out.error for out in outputs):
            raise CaptionError(outputs, names)
        return [out.outputs[0].text for out in outputs]

    # ---- retrieval: Pipeline("qwen3-vl-embedding-2b") / Pipeline("qwen3-vl-reranker-2b");
    # docs/retrieval.md ----
    def embed(self, images: Iterable | None = None, texts: Iterable[str] | None = None,
              videos: Iterable | None = None, items: Iterable | None = None,
              instruction: str | None = None, dimensions: int | None = None) -> list[list[float]]:
        """One normalized vector per item, in the Qwen embedder's format (the instruction as the
        system turn): `items` first (each a string or a dict mixing "text", "image", "video"), then
        each image, video and text as an item of its own. dimensions=k keeps the leading k entries
        (Matryoshka), renormalized."""
        items = list(items or []) + [{"image": x} for x in images or []] + \
            [{"video": x} for x in videos or []] + [{"text": x} for x in texts or []]
        if not items:
            raise ValueError("nothing to embed: give images, texts, videos or items")
        prompts = [embedding_prompt(self.engine, item, instruction) for item in items]
        outs = self.llm.embed(prompts, PoolingParams(dimensions=dimensions), use_tqdm=False)
        return [out.outputs.embedding for out in outs]

    def rerank(self, query, candidates: Iterable, instruction: str | None = None,
               top_k: int | None = None) -> list[dict]:
        """Candidates ranked by relevance to the query, best first: [{"index", "score",
        "document"}]. A reranker scores each (query, candidate) pair; an embedder ranks by the
        cosine of the query's embedding (with the instruction) and each candidate's (with the
        default one)."""
        candidates = list(candidates)
        if not candidates:
            return []
        if self.engine.pooling is not None and self.engine.pooling.task == "classify":
            scores = [out.outputs.score for out in self.llm.score(query, candidates, use_tqdm=False,
                                                                   instruction=instruction)]
        else:
            query_vector, = self.embed(items=[query], instruction=instruction)
            scores = [
                clamp_cosine(sum(a * b for a, b in zip(query_vector, vector)))
                for vector in self.embed(items=candidates)
            ]
        ranked = sorted(range(len(candidates)), key=lambda i: -scores[i])[:top_k]
        return [{"index": i, "score": scores[i], "document": candidates[i]} for i in ranked]


def thinking_kwargs(thinking: bool | None) -> dict | None:
    """Pipeline's thinking= as the chat template variable Qwen3's and Qwen3.5's templates read."""
    return None if thinking is None else {"enable_thinking": bool(thinking)}


def is_image_source(value) -> bool:
    """A string or path that names an image: an existing file, a URL, a data URI, or a file name
    with an image extension (a missing one is then reported as a missing image)."""
    if not isinstance(value, (str, os.PathLike)):
        return True
    text = os.fspath(value)
    return text.startswith(("data:", "http://", "https://", "file://")) or \
        os.path.exists(text) or text.lower().endswith(IMAGE_EXTENSIONS)


def caption_inputs(images) -> list:
    """Pipeline.caption's images as a list: a string is a folder, a glob, a .txt list or a path
    (never iterated letter by letter); one image alone (bytes, a PIL image, an array) is a list of
    one."""
    if isinstance(images, (str, os.PathLike)):
        images = [images]
    elif isinstance(images, (bytes, bytearray, dict)) or hasattr(images, "shape") or \
            not isinstance(images, Iterable):
        return [images]
    found = []
    for item in images:
        item = os.fspath(item) if isinstance(item, os.PathLike) else item
        if isinstance(item, str) and "://" not in item and not item.startswith("data:"):
            found.extend(collect_images([item]))
        else:
            found.append(item)
    if not found:
        raise ValueError("nothing to caption: no images given")
    return found


def media_options(mm_processor_kwargs: dict | None, sampling: dict) -> dict | None:
    """mm_processor_kwargs with the MEDIA_KEYWORDS taken out of `sampling` (the keyword arguments
    of a Pipeline call); one given both ways is an error."""
    given = {name: sampling.pop(name) for name in MEDIA_KEYWORDS if name in sampling}
    if not given:
        return mm_processor_kwargs
    twice = sorted(set(given) & set(mm_processor_kwargs or {}))
    if twice:
        raise ValueError(f"{', '.join(twice)} given both as a keyword and in mm_processor_kwargs: "
                         "give each once")
    return {**(mm_processor_kwargs or {}), **given}


def embedding_prompt(engine, item, instruction: str | None = None) -> dict:
    """One item as the Qwen embedder's prompt: its conversation (inputs/retrieval.py
    embedding_messages), media sized as its code sizes them. Pipeline.embed and the batch embedder
    (`vlinfer embed`) both build it here."""
    messages = embedding_messages(item, instruction)
    return engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs(messages))
