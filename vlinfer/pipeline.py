"""`Pipeline("qwen3-vl")`: images and text in, text out. A thin layer over LLM for the common cases.
"""
from collections.abc import Iterable, Iterator

from vlinfer.config import ANSWER_MAX_TOKENS
from vlinfer.engine.drive import drive
from vlinfer.inputs.limits import text_only
from vlinfer.inputs.retrieval import embedding_messages, mm_processor_kwargs
from vlinfer.llm import LLM
from vlinfer.lora_request import LoRARequest
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams


class Pipeline:
    """pipe(image, prompt) -> answer; pipe.chat(messages); pipe.stream(...) yields text deltas;
    pipe.caption(images) -> captions in order. Sampling options (temperature, top_p, max_tokens,
    seed, ...) pass through as keyword arguments; the rest of **engine_options go to LLM. lora=PATH:
    a PEFT LoRA adapter folder every request runs with (LoRARequest.from_path: named after its
    folder; enable_lora is set for it, max_lora_rank must hold its rank); it is read and checked
    here, so a bad one fails now, named."""

    def __init__(self, model: str = "qwen3-vl", *, lora: str | None = None, **engine_options):
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

    @staticmethod
    def sampling_params(sampling_params: SamplingParams | None = None, **options) -> SamplingParams:
        if sampling_params is not None:
            if options:
                raise ValueError(
                    "pass either sampling_params or sampling keyword options, not both")
            return sampling_params
        # SamplingParams' 16 would cut most answers short
        options.setdefault("max_tokens", ANSWER_MAX_TOKENS)
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

    def __call__(self, image=None, prompt: str | None = None, *, images: Iterable | None = None,
                 video=None, videos: Iterable | None = None,
                 sampling_params: SamplingParams | None = None,
                 mm_processor_kwargs: dict | None = None, **sampling) -> str:
        """video / videos: a path, bytes, data URI, frames (or (frames, metadata));
        mm_processor_kwargs takes fps, num_frames, max_frames, video_max_pixels ... for them."""
        if isinstance(image, str) and prompt is None and images is None and not self.is_multimodal:
            image, prompt = None, image  # text model: pipe("question")
        images = ([image] if image is not None else []) + list(images or [])
        videos = ([video] if video is not None else []) + list(videos or [])
        return self.chat(self.messages(prompt, images, videos), sampling_params,
                         mm_processor_kwargs, **sampling)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             mm_processor_kwargs: dict | None = None, **sampling) -> str:
        """mm_processor_kwargs: {"min_pixels": ..., "max_pixels": ...} for this request's images."""
        params = self.sampling_params(sampling_params, **sampling)
        return self.llm.chat(messages, params, use_tqdm=False,
                             mm_processor_kwargs=mm_processor_kwargs,
                             lora_request=self.lora_request)[0].outputs[0].text

    def stream(self, image=None, prompt: str | None = None, *, images: Iterable | None = None,
               messages: list[dict] | None = None, sampling_params: SamplingParams | None = None,
               mm_processor_kwargs: dict | None = None,
               **sampling) -> Iterator[str] | Iterator[tuple[int, str]]:
        """Yield text deltas as tokens arrive (never half a multi-byte character). With n > 1,
        (index, delta) pairs instead, so each completion's text stays apart; the stream ends when
        all n have finished. Closing the generator early aborts the request and frees its blocks."""
        if messages is None:
            if isinstance(image,
                          str) and prompt is None and images is None and not self.is_multimodal:
                image, prompt = None, image
            messages = self.messages(prompt,
                                     ([image] if image is not None else []) + list(images or []))
        params = self.sampling_params(sampling_params, **sampling)
        prompt_dict = self.engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs)
        request_id = self.engine.add_request(prompt_dict, params, lora_request=self.lora_request)
        for out in drive(self.engine, [request_id]):  # closed early: drive aborts the request
            delta, index = out.outputs[0].delta_text, out.outputs[0].index
            if delta:
                yield delta if params.n == 1 else (index, delta)

    def caption(self, images: Iterable, prompt: str = "Describe this image.", batch_size: int = 8,
                sampling_params: SamplingParams | None = None,
                mm_processor_kwargs: dict | None = None, **sampling) -> list[str]:
        """Captions in input order. An image that cannot be read raises RequestError naming it after
        the others finished (their captions are in the error's outputs)."""
        if not self.is_multimodal:
            raise ValueError(text_only(self.model, "images",
                                       self.engine.input_processor.language_model_only))
        params = self.sampling_params(sampling_params, **sampling)
        images = list(images)
        captions = []
        for start in range(0, len(images), batch_size):
            batch = [self.messages(prompt, [image]) for image in images[start:start + batch_size]]
            outs = self.llm.chat(batch, params, use_tqdm=False,
                                 mm_processor_kwargs=mm_processor_kwargs,
                                 lora_request=self.lora_request)
            captions.extend(out.outputs[0].text for out in outs)
        return captions

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
                sum(a * b for a, b in zip(query_vector, vector))
                for vector in self.embed(items=candidates)
            ]
        ranked = sorted(range(len(candidates)), key=lambda i: -scores[i])[:top_k]
        return [{"index": i, "score": scores[i], "document": candidates[i]} for i in ranked]


def embedding_prompt(engine, item, instruction: str | None = None) -> dict:
    """One item as the Qwen embedder's prompt: its conversation (inputs/retrieval.py
    embedding_messages), media sized as its code sizes them. Pipeline.embed and the batch embedder
    (`vlinfer embed`) both build it here."""
    messages = embedding_messages(item, instruction)
    return engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs(messages))
