"""Requests in: any accepted prompt form (text, token ids, a dict with images and videos, a chat
conversation) and its SamplingParams become the Sequences the engine runs, or a ValueError naming
what is wrong. Runs in the caller's thread and touches no engine state, so a slow image never stalls
a step."""
import torch

from vlinfer.engine.sequence import Sequence
from vlinfer.inputs import PromptType
from vlinfer.inputs.limits import text_only
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams
from vlinfer.structured.reasoning import (RESERVED_TEMPLATE_KWARGS, ReasoningState,
                                          resolve_reasoning_parser)

PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
MEDIA_KEYS = {"image", "video"}


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, model_name: str, max_model_len: int,
                 mm_processor=None, chat_template: str | None = None, grammar_matchers=None,
                 device: torch.device | None = None, seed: int = 0, pooling=None,
                 can_generate: bool = True, lora=None, language_model_only: bool = False,
                 reasoning_parser=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.max_model_len = max_model_len  # the resolved one (engine/sizing.py)
        # vlinfer.multimodal's processor; None for a text-only model
        self.mm_processor = mm_processor
        self.chat_template = chat_template
        self.grammar_matchers = grammar_matchers
        self.device = device or torch.device("cpu")
        # Draws come from the engine's own generators; torch's global RNG stays the caller's.
        self._seed_source = torch.Generator().manual_seed(seed)
        # engine/pooling.py's PoolingSpec of a pooling engine; None: it generates only
        self.pooling = pooling
        self.can_generate = can_generate  # False: an embedder without an LM head
        self.lora = lora  # engine/lora_manager.py's LoRAManager when LoRA is enabled
        # a vision-language model run without its tower: media refused naming the option
        self.language_model_only = language_model_only
        # structured/reasoning.py's parser of this engine's outputs; None: the text is not split
        self.reasoning_parser = reasoning_parser

    @classmethod
    def of_model(cls, source, hf_config, tokenizer, device: torch.device, max_model_len: int,
                 multimodal: bool, allow_image_urls=False, grammar_matchers=None, seed: int = 0,
                 pooling=None, can_generate: bool = True, lora=None,
                 language_model_only: bool = False,
                 reasoning_parser: str | None = "auto") -> "InputProcessor":
        """The processor of one model (a loading.ModelSource, its config and tokenizer): its
        vocabulary and chat template, with a vision tower (multimodal, not language_model_only)
        its media processor, and the reasoning parser the option and the template resolve to; the
        rest as the constructor takes them."""
        from vlinfer.multimodal import Qwen3VLInputProcessor, load_chat_template
        takes_media = multimodal and not language_model_only
        mm_processor = Qwen3VLInputProcessor(hf_config, tokenizer, source.folder, device,
                                             allow_image_urls) if takes_media else None
        template = load_chat_template(source.folder, tokenizer, multimodal)  # the checkpoint's
        vocab_size = hf_config.get_text_config().vocab_size
        parser = resolve_reasoning_parser(reasoning_parser, template, tokenizer, vocab_size) \
            if can_generate else None
        return cls(tokenizer, vocab_size, source.name, max_model_len, mm_processor, template,
                   grammar_matchers, device, seed, pooling, can_generate, lora,
                   language_model_only and multimodal, parser)

    @property
    def is_multimodal(self) -> bool:
        return self.mm_processor is not None

    def _refuse_media(self, what: str) -> None:
        if not self.is_multimodal:
            raise ValueError(text_only(self.model_name, what, self.language_model_only))

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                       ) -> tuple[str | None, list[int], dict]:
        """(prompt text, token ids, extra Sequence fields) for any accepted prompt form; ValueError
        otherwise. truncate_prompt_tokens=k keeps the last k prompt tokens (-1: max_model_len),
        counted after image placeholders are expanded, as SamplingParams.truncate_prompt_tokens in
        vLLM."""
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        text, token_ids, mm_data, mm_kwargs = self._split_prompt(prompt)
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a str, got {type(text).__name__}")
            token_ids = self.tokenizer(text).input_ids
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty")
        extra = {}
        if self.is_multimodal:
            images, videos = _media(mm_data)
            processed = self.mm_processor.process(token_ids, images, mm_kwargs, videos,
                                                  keep_last=keep)
            token_ids = processed.token_ids
            if processed.videos and len(token_ids) > self.max_model_len:
                # Said here, naming the clips: "the prompt is too long" alone does not tell what to
                # lower.
                raise ValueError(
                    f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                    f"{self.max_model_len}; its videos take "
                    f"{', '.join(str(v['num_tokens']) for v in processed.videos)} tokens: lower "
                    "fps / num_frames / max_frames / video_max_pixels in mm_processor_kwargs")
            extra = {
                "mm_items": processed.mm_items, "mrope_positions": processed.mrope_positions,
                "mrope_position_delta": processed.mrope_position_delta,
                "images_info": processed.images, "videos_info": processed.videos
            }
        elif keep is not None:
            token_ids = token_ids[-keep:]
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids out of the vocabulary range [0, {self.vocab_size}): {bad[:5]}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return text, token_ids, extra

    def _split_prompt(self,
                      prompt: PromptType) -> tuple[str | None, list[int] | None, dict, dict | None]:
        """(text, token ids, multi_modal_data, mm_processor_kwargs) of one prompt form."""
        if isinstance(prompt, str):
            return prompt, None, {}, None
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), {}, None
        if not isinstance(prompt, dict):
            raise ValueError(
                "a prompt must be a str, a list of token ids or a dict, got "
                f"{type(prompt).__name__}"
            )
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise ValueError(f"unknown prompt keys {sorted(unknown)}")
        mm_data = prompt.get("multi_modal_data") or {}
        if mm_data:
            self._refuse_media("images")
        unknown = set(mm_data) - MEDIA_KEYS
        if unknown:
            raise ValueError(
                f"unsupported multi_modal_data keys {sorted(unknown)}; 'image' and 'video' are "
                "supported"
            )
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"], mm_data, prompt.get(
                "mm_processor_kwargs")
        if "prompt" in prompt:
            return prompt["prompt"], None, mm_data, prompt.get("mm_processor_kwargs")
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")

    def sampling_token_ids(self, p: SamplingParams) -> list[list[int]]:
        """Checks logit_bias and allowed_token_ids against the model's vocabulary (vLLM refuses ids
        outside it too) and returns bad_words as token sequences, vLLM's way: each word as the start
        of the text and, when that gives a different first token of the same length, after a space
        (mid-text). A sequence with a token the model cannot produce can never appear and is left
        out."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", p.logit_bias or
                           {}), ("allowed_token_ids", p.allowed_token_ids or [])):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} has token ids outside the vocabulary [0, {vocab}): "
                    f"{outside[:5]}")
        words = []
        for word in p.bad_words or []:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:  # nothing the tokenizer can spell: nothing to ban
                continue
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        return [w for w in words if max(w) < vocab]

    def make_sequences(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, lora_request=None) -> list[Sequence]:
        """Validate a request and build its sampling_params.n Sequences, one per completion. The
        prompt (and its images) is processed once; the completions share its token ids and encoder
        inputs. With n > 1 each sequence's own id is f"{request_id}#{index}"."""
        adapter = self.check_lora(lora_request) if lora_request is not None else None
        seqs = self._make_sequences(prompt, sampling_params, request_id)
        vision_lora = self.lora.vision_lora(lora_request,
                                            adapter) if lora_request is not None else None
        for seq in seqs:
            seq.lora_request, seq.lora_adapter, seq.vision_lora = lora_request, adapter, vision_lora
        return seqs

    def check_lora(self, lora_request):
        """Read and check an adapter (LoRAManager.check): its host copy, or a ValueError naming it
        and why, or that LoRA is off."""
        if self.lora is None:
            raise ValueError(
                f"a LoRA adapter ({getattr(lora_request, 'lora_name', lora_request)!r}) was asked "
                "for, but LoRA is off: LLM(..., enable_lora=True)")
        return self.lora.check(lora_request)

    def _make_sequences(self, prompt: PromptType, sampling_params,
                        request_id: str) -> list[Sequence]:
        if isinstance(sampling_params, PoolingParams):
            return [self._pooling_sequence(prompt, sampling_params, request_id)]
        if not self.can_generate:
            raise ValueError(
                f"model {self.model_name!r} has no LM head (an embedding model): it cannot "
                "generate; "
                "use LLM.embed / LLM.score")
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        text, token_ids, extra = self.process_prompt(prompt, sampling_params.truncate_prompt_tokens)
        bad_words_token_ids = self.sampling_token_ids(sampling_params)
        # Compiled here, in the caller's thread, once per distinct constraint (the cache): never in
        # a step.
        constraint = sampling_params.structured_outputs
        compiled_grammar = self.grammar_matchers.compile(
            constraint) if constraint is not None else None
        budget = sampling_params.thinking_token_budget
        parser = self.reasoning_parser
        if budget is not None and parser is None:
            raise ValueError("SamplingParams.thinking_token_budget needs a reasoning parser: "
                             "LLM(..., reasoning_parser='qwen3')")
        if budget is not None and parser.end_token_id >= self.vocab_size:
            raise ValueError(f"SamplingParams.thinking_token_budget: the model's vocabulary "
                             f"({self.vocab_size}) has no {parser.end_token} to end thinking with")
        n = sampling_params.n
        ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        images_info = extra.pop("images_info", [])
        videos_info = extra.pop("videos_info", [])
        seqs = []
        for index, seq_id in enumerate(ids):
            params = sampling_params if n == 1 else sampling_params.for_completion(index)
            # Every sequence samples from its own generator: seeded ones from their seed, others
            # from a seed drawn from the engine's seed, so runs repeat and batch composition never
            # changes a draw.
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2 ** 62, (), generator=self._seed_source))
            generator = torch.Generator(device=self.device).manual_seed(seed)
            seq = Sequence(token_ids, params, request_id=seq_id, prompt=text, generator=generator,
                           **extra)
            seq.parent_id, seq.index = request_id, index
            seq.request_group = request_id
            seq.images_info = images_info
            seq.videos_info = videos_info
            seq.bad_words_token_ids = bad_words_token_ids
            if compiled_grammar is not None:  # each completion walks the grammar on its own
                seq.grammar_matcher = compiled_grammar.deep_copy()
            if parser is not None:  # the constraint covers the answer after the thinking
                seq.reasoning = ReasoningState(parser, token_ids, budget)
                seq.grammar_matcher = seq.reasoning.park(seq.grammar_matcher)
            seqs.append(seq)
        return seqs

    def _pooling_sequence(self, prompt: PromptType, params: PoolingParams,
                          request_id: str) -> Sequence:
        if self.pooling is None:
            raise ValueError(
                f"model {self.model_name!r} runs the generate runner: embedding and scoring "
                "requests "
                "need a pooling engine (LLM(model, runner='pooling'), or an embedding / reranker "
                "model)"
            )
        self.pooling.check(params, self.model_name)
        text, token_ids, extra = self.process_prompt(prompt, params.truncate_prompt_tokens)
        images_info, videos_info = extra.pop("images_info", []), extra.pop("videos_info", [])
        seq = Sequence(token_ids, None, request_id=request_id, prompt=text, **extra)
        seq.pooling_params = params
        seq.images_info, seq.videos_info = images_info, videos_info
        return seq

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, mm_processor_kwargs: dict | None = None,
                    tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> dict:
        """One conversation (OpenAI-style content parts allowed) -> a prompt dict for add_request /
        generate. tools: OpenAI tool definitions, rendered by the template (which must read them).
        chat_template_kwargs: more variables for the template (vLLM's), e.g. enable_thinking.
        Whatever is wrong with the conversation is a ValueError, so callers answer it as a bad
        request."""
        from vlinfer.multimodal.chat import (ToolsNotRenderedError, image_details, message_texts,
                                             split_chat_media, template_renders_tools,
                                             with_image_details, with_video_options)
        if not isinstance(messages, (list, tuple)):
            raise ValueError(
                f"a conversation must be a list of message dicts, got {type(messages).__name__}")
        template_messages, images, videos = split_chat_media(messages)
        if images or videos:
            self._refuse_media("images" if images else "videos")
        if self.is_multimodal:
            for text in message_texts(template_messages, tools):
                self.mm_processor.check_user_text(text)
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"model {self.model_name!r} has no chat template; pass chat_template=")
        if tools and not template_renders_tools(template):
            raise ToolsNotRenderedError(self.model_name,
                                        "pass a chat_template= that reads `tools`")
        extra = check_template_kwargs(chat_template_kwargs)
        try:
            text = self.tokenizer.apply_chat_template(template_messages, tokenize=False,
                                                      chat_template=template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **({"tools": tools} if tools else {}),
                                                      **extra)
        except ValueError:
            raise
        # jinja's TemplateError (a role the template refuses), a TypeError on odd content
        except Exception as e:
            raise ValueError(
                f"the chat template cannot render this conversation: {type(e).__name__}: {e}"
            ) from e
        prompt = {
            "prompt": text, "prompt_token_ids": self.tokenizer(text,
                                                               add_special_tokens=False).input_ids
        }
        if images or videos:
            prompt["multi_modal_data"] = {"image": images, **({"video": videos} if videos else {})}
        # image_url.detail
        mm_processor_kwargs = with_image_details(mm_processor_kwargs, image_details(messages))
        # a video part's fps, num_frames
        mm_processor_kwargs = with_video_options(mm_processor_kwargs, messages)
        if mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return prompt


def check_template_kwargs(kwargs: dict | None) -> dict:
    """chat_template_kwargs as given, or a ValueError naming what is wrong: a dict of variables
    with string names, none that the engine itself passes to the template."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be a dict of template variables, e.g. "
                         "{'enable_thinking': False}")
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {reserved}: the request's own fields "
                         "set them")
    return kwargs


def _media(mm_data: dict) -> tuple[list, list]:
    """(images, videos) of a multi_modal_data dict. One video is a path, bytes, a frames array or a
    (frames, metadata) pair; a list holds several."""
    images = mm_data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    videos = mm_data.get("video", [])
    videos = list(videos) if isinstance(videos, list) else [videos]
    return images, videos
