"""The engine loop: requests in, scheduler step, model step, incremental outputs out."""
import logging
import time
from itertools import count

import torch

from vlinfer import model_loader, ops, platform
from vlinfer.config import EngineConfig, default_batched_tokens
from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.detokenizer import IncrementalDetokenizer
from vlinfer.distributed import ParallelConfig, TPDriver
from vlinfer.engine.model_runner import ModelRunner, load_model
from vlinfer.engine.scheduler import Scheduler
from vlinfer.engine.sequence import Sequence
from vlinfer.layers import ModelContext
from vlinfer.layers.distributed import SINGLE
from vlinfer.models import get_model_class
from vlinfer.outputs import CompletionOutput, RequestOutput
from vlinfer.sampling_params import SamplingParams
from vlinfer.structured.matchers import GrammarMatchers

logger = logging.getLogger("vlinfer")

PromptType = str | list[int] | dict


def check_tensor_parallel_shapes(text_config, tp: int, expert_parallel: bool = False) -> None:
    """Query heads and the MLP split evenly; KV heads split evenly or, when fewer than ranks, replicate. MoE
    experts split along their intermediate dimension, or (expert_parallel) whole experts over the ranks."""
    if tp == 1:
        return
    heads, kv = text_config.num_attention_heads, text_config.num_key_value_heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by it")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    if text_config.intermediate_size % tp:
        problems.append(f"intermediate_size={text_config.intermediate_size} is not divisible by it")
    num_experts = getattr(text_config, "num_experts", 0) or 0
    if num_experts and expert_parallel and num_experts % tp:
        problems.append(f"num_experts={num_experts} is not divisible by it (enable_expert_parallel)")
    if num_experts and not expert_parallel and text_config.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={text_config.moe_intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not fit this model: " + "; ".join(problems))


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = EngineConfig(model=model, **kwargs)
        parallel = ParallelConfig.of(config)
        if parallel.launched_externally and parallel.rank != 0:
            # torchrun (or similar) started this script on every rank: rank 0 runs the engine, this rank serves
            # it, then the process ends with the engine. Code after LLM(...) runs on rank 0 only.
            from vlinfer.engine.worker import serve_from_env
            serve_from_env(parallel)  # does not return
        self.config = config
        self.parallel = parallel
        self.driver: TPDriver | None = None
        self.grammar_matchers: GrammarMatchers | None = None  # built in _init; close() may run before
        self.device = platform.resolve_device(config.device)  # a mistyped device fails before any model work
        self.source = model_loader.resolve_model(model)
        if config.tensor_parallel_size > 1:  # start the workers now: they import torch while we read the config
            self.driver = TPDriver(parallel, self.device.type)
            self.device = self.driver.device
        try:
            self._init(config)
        except BaseException:
            self.close()
            raise

    def _init(self, config: EngineConfig) -> None:
        self.hf_config = model_loader.load_config(self.source)
        self.tokenizer = model_loader.load_tokenizer(self.source)
        self.dtype = platform.resolve_dtype(config.dtype, self.hf_config, self.device)
        self.text_config = self.hf_config.get_text_config()  # the decoder's config, nested in multimodal ones
        model_len = getattr(self.text_config, "max_position_embeddings", None) or 4096
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_len}")
        fit_model_len = config.max_model_len is None
        # Fitted: until the KV pool is sized (in _build), the longest it may become.
        self.max_model_len = config.max_model_len or min(model_len, config.max_model_len_cap or model_len)
        fit_batched_tokens = config.max_num_batched_tokens is None
        if fit_batched_tokens:
            config.max_num_batched_tokens = default_batched_tokens(self.max_model_len)
        if config.kvcache_block_size is None:
            config.kvcache_block_size = platform.default_block_size(self.device)
        # The engine's draws come from its own generators; torch's global RNG stays the caller's.
        self._seed_source = torch.Generator().manual_seed(config.seed)
        get_model_class(self.hf_config)  # an unsupported architecture fails here, before the workers load
        check_tensor_parallel_shapes(self.text_config, config.tensor_parallel_size, config.enable_expert_parallel)
        self._build(config)
        if fit_model_len:
            self._fit_max_model_len(model_len)
            if fit_batched_tokens:  # the fitted length may be shorter than the step budget
                config.max_num_batched_tokens = default_batched_tokens(self.max_model_len)
        # After the fit: graphs are captured for the block tables of the length the engine will run.
        self.model_runner.capture_graphs(self.max_model_len)
        from vlinfer.multimodal import load_chat_template
        self.chat_template = load_chat_template(self.source.folder, self.tokenizer, self.is_multimodal)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, tuple[Sequence, IncrementalDetokenizer]] = {}
        self._request_ids = count()

    def _build(self, config: EngineConfig) -> None:
        """Model (rank 0's shard, while the workers load theirs), model runner, KV pool, block manager."""
        start = time.perf_counter()
        group = SINGLE
        if self.driver is not None:
            self.driver.start_workers({"source": self.source, "hf_config": self.hf_config, "config": config,
                                       "dtype": self.dtype, "device_type": self.device.type})
            group = self.driver.group
        # This engine's own op table and step state: another engine in the process never sees them.
        self.model_context = ModelContext(ops.select(self.device.type, forced=config.ops), group,
                                          expert_parallel=config.enable_expert_parallel)
        net = load_model(self.source, self.hf_config, self.device, self.dtype, self.model_context,
                         config.quantization)
        if self.driver is not None:
            self.driver.wait_ready()
        logger.info("loaded %s (%s) on %s in %s in %.1fs%s", self.source.name, type(net).__name__, self.device,
                    self.dtype, time.perf_counter() - start,
                    f", tensor parallel over {group.size} ranks" if group.size > 1 else "")
        self.eos_token_ids = self._eos_token_ids()
        self.ops_implementation = self.model_context.ops.name
        self.is_multimodal = hasattr(net, "encode_images")
        self.input_processor = None
        if self.is_multimodal:
            from vlinfer.multimodal import Qwen3VLInputProcessor
            self.input_processor = Qwen3VLInputProcessor(self.hf_config, self.tokenizer, self.source.folder,
                                                         self.device, config.allow_image_urls)
        # Structured outputs over the logits' width; nothing is built until a request is constrained.
        self.grammar_matchers = GrammarMatchers(self.tokenizer, self.text_config.vocab_size, self.eos_token_ids)
        self.model_runner = ModelRunner(config, self.hf_config, net, self.model_context, self.device, self.dtype,
                                        self.eos_token_ids, self.driver, self.grammar_matchers)
        num_blocks = self.model_runner.num_blocks_for_budget(self.max_model_len)
        self.model_runner.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB%s, %d tokens)", num_blocks, config.kvcache_block_size,
                    num_blocks * self.model_runner.bytes_per_block / 2 ** 20,
                    " per rank" if self.driver is not None else "", num_blocks * config.kvcache_block_size)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)

    def _fit_max_model_len(self, model_len: int) -> None:
        """No max_model_len was given: if the KV pool holds fewer tokens than the model's length (at most
        max_model_len_cap), the longest sequence the pool holds, in whole blocks."""
        cfg = self.config
        allowed = f"the model's max_position_embeddings={model_len}"
        if self.max_model_len < model_len:
            allowed = f"max_model_len_cap={cfg.max_model_len_cap}; the model allows {model_len}"
        num_blocks = self.block_manager.num_blocks
        pool_tokens = num_blocks * cfg.kvcache_block_size
        if pool_tokens >= self.max_model_len:
            logger.info("max_model_len=%d (%s)", self.max_model_len, allowed)
            return
        logger.warning("max_model_len=%d: the KV cache (%d blocks of %d tokens, %.1f MiB%s) holds fewer tokens than "
                       "%s, so the context length is fitted to it. To raise it, raise kv_cache_bytes or "
                       "memory_utilization; a max_model_len you pass is used as is, and must fit", pool_tokens,
                       num_blocks, cfg.kvcache_block_size, num_blocks * self.model_runner.bytes_per_block / 2 ** 20,
                       " per rank" if self.driver is not None else "", allowed)
        self.max_model_len = pool_tokens

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one rank). Also runs when the engine is garbage collected
        and at interpreter exit."""
        if self.grammar_matchers is not None:
            self.grammar_matchers.close()
        if self.driver is not None:
            self.driver.close()

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if not self.source.gguf_file:
            from transformers import GenerationConfig
            try:
                eos = GenerationConfig.from_pretrained(self.source.path).eos_token_id
            except OSError:  # no generation_config.json
                eos = None
            ids.update([eos] if isinstance(eos, int) else eos or [])
        return ids

    # ---- requests ----
    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                       ) -> tuple[str | None, list[int], dict]:
        """(prompt text, token ids, extra request fields) for any accepted prompt form; ValueError otherwise.
        truncate_prompt_tokens=k keeps the last k prompt tokens (-1: max_model_len), counted after image
        placeholders are expanded, as SamplingParams.truncate_prompt_tokens in vLLM."""
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        extra = {}
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}")
            if prompt.get("multi_modal_data") and not self.is_multimodal:
                raise ValueError(f"model {self.source.name!r} ({type(self.model_runner.model).__name__}) is a "
                                 "text-only model and does not accept images")
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, token_ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a str, got {type(text).__name__}")
            token_ids = self.tokenizer(text).input_ids
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if self.is_multimodal:
            mm_data = prompt.get("multi_modal_data") or {} if isinstance(prompt, dict) else {}
            unknown = set(mm_data) - {"image", "video"}
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys {sorted(unknown)}; 'image' and 'video' are "
                                 "supported")
            images = mm_data.get("image", [])
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            # One video is a path, bytes, a frames array or a (frames, metadata) pair; a list holds several.
            videos = mm_data.get("video", [])
            videos = list(videos) if isinstance(videos, list) else [videos]
            mm_kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
            processed = self.input_processor.process(token_ids, images, mm_kwargs, videos)
            cut = 0 if keep is None else len(processed.token_ids) - keep
            if cut > 0:
                first_image = processed.first_mm_token if processed.first_mm_token is not None else \
                    len(processed.token_ids)
                if cut > first_image:
                    raise ValueError(f"truncate_prompt_tokens={truncate_prompt_tokens} keeps the last {keep} of "
                                     f"{len(processed.token_ids)} prompt tokens, which cuts into image 0 (its "
                                     f"placeholders start at token {first_image}); keep at least "
                                     f"{len(processed.token_ids) - first_image}")
                # All that is cut is text before the first image, where the expanded and the unexpanded prompt
                # agree: cutting the unexpanded one recomputes placeholder offsets and rotary positions for it.
                processed = self.input_processor.process(token_ids[cut:], images, mm_kwargs, videos)
            token_ids = processed.token_ids
            if processed.videos and len(token_ids) > self.max_model_len:
                # Said here, naming the clips: "the prompt is too long" alone does not tell what to lower.
                raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                                 f"{self.max_model_len}; its videos take "
                                 f"{', '.join(str(v['num_tokens']) for v in processed.videos)} tokens: lower "
                                 "fps / num_frames / max_frames / video_max_pixels in mm_processor_kwargs")
            extra = {"mm_items": processed.mm_items, "mrope_positions": processed.mrope_positions,
                     "mrope_position_delta": processed.mrope_position_delta, "images_info": processed.images,
                     "videos_info": processed.videos}
        elif keep is not None:
            token_ids = token_ids[-keep:]
        vocab = self.text_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary range [0, {vocab}): {bad[:5]}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        return text, token_ids, extra

    def make_sequences(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> list[Sequence]:
        """Validate a request and build its sampling_params.n Sequences, one per completion, without touching
        engine state. The prompt (and its images) is processed once; the completions share its token ids and
        encoder inputs. With n > 1 each sequence's own id is f"{request_id}#{index}"."""
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        text, token_ids, extra = self.process_prompt(prompt, sampling_params.truncate_prompt_tokens)
        bad_words_token_ids = self.sampling_token_ids(sampling_params)
        # Compiled here, in the caller's thread, once per distinct constraint (the cache): never in a step.
        constraint = sampling_params.structured_outputs
        compiled_grammar = self.grammar_matchers.compile(constraint) if constraint is not None else None
        if request_id is None:
            request_id = str(next(self._request_ids))
        n = sampling_params.n
        ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        if any(i in self.requests for i in {request_id, f"{request_id}#0", *ids}):
            raise ValueError(f"request id {request_id!r} is already in use")
        images_info = extra.pop("images_info", [])
        videos_info = extra.pop("videos_info", [])
        seqs = []
        for index, seq_id in enumerate(ids):
            params = sampling_params if n == 1 else sampling_params.for_completion(index)
            # Every sequence samples from its own generator: seeded ones from their seed, others from a seed
            # drawn from the engine's seed, so runs repeat and batch composition never changes a draw.
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2 ** 62, (), generator=self._seed_source))
            generator = torch.Generator(device=self.device).manual_seed(seed)
            seq = Sequence(token_ids, params, request_id=seq_id, prompt=text, generator=generator, **extra)
            seq.parent_id, seq.index = request_id, index
            seq.images_info = images_info
            seq.videos_info = videos_info
            seq.bad_words_token_ids = bad_words_token_ids
            if compiled_grammar is not None:  # each completion walks the grammar on its own
                seq.grammar_matcher = compiled_grammar.deep_copy()
            seqs.append(seq)
        return seqs

    def sampling_token_ids(self, p: SamplingParams) -> list[list[int]]:
        """Checks logit_bias and allowed_token_ids against the model's vocabulary (vLLM refuses ids outside it
        too) and returns bad_words as token sequences, vLLM's way: each word as the start of the text and, when
        that gives a different first token of the same length, after a space (mid-text). A sequence with a token
        the model cannot produce can never appear and is left out."""
        vocab = self.text_config.vocab_size
        for name, ids in (("logit_bias", p.logit_bias or {}), ("allowed_token_ids", p.allowed_token_ids or [])):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"SamplingParams.{name} has token ids outside the vocabulary [0, {vocab}): "
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

    def make_sequence(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """make_sequences for callers that queue one sequence per request (the engine loop, the server)."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(f"SamplingParams.n={sampling_params.n}: this call makes one completion; "
                             "LLM.generate, LLM.chat and LLMEngine.add_request run n")
        return self.make_sequences(prompt, sampling_params, request_id)[0]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, mm_processor_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> dict:
        """One conversation (OpenAI-style content parts allowed) -> a prompt dict for add_request / generate.
        tools: OpenAI tool definitions, rendered by the template (which must read them). Whatever is wrong with
        the conversation is a ValueError, so callers answer it as a bad request."""
        from vlinfer.multimodal.chat import (image_details, message_texts, split_chat_media, template_renders_tools,
                                             with_image_details, with_video_options)
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"a conversation must be a list of message dicts, got {type(messages).__name__}")
        template_messages, images, videos = split_chat_media(messages)
        if (images or videos) and not self.is_multimodal:
            raise ValueError(f"model {self.source.name!r} is a text-only model and does not accept "
                             f"{'images' if images else 'videos'}")
        if self.is_multimodal:
            for text in message_texts(template_messages, tools):
                self.input_processor.check_user_text(text)
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"model {self.source.name!r} has no chat template; pass chat_template=")
        if tools and not template_renders_tools(template):
            raise ValueError(f"the chat template of model {self.source.name!r} does not render tools, so the model "
                             "would never see them; pass a chat_template that does")
        try:
            text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **({"tools": tools} if tools else {}))
        except ValueError:
            raise
        except Exception as e:  # jinja's TemplateError (a role the template refuses), a TypeError on odd content
            raise ValueError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from e
        prompt = {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids}
        if images or videos:
            prompt["multi_modal_data"] = {"image": images, **({"video": videos} if videos else {})}
        mm_processor_kwargs = with_image_details(mm_processor_kwargs, image_details(messages))  # image_url.detail
        mm_processor_kwargs = with_video_options(mm_processor_kwargs, messages)  # a video part's fps, num_frames
        if mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return prompt

    def add_sequence(self, seq: Sequence) -> str:
        p = seq.sampling_params
        self.requests[seq.request_id] = (seq, IncrementalDetokenizer(self.tokenizer, seq.num_prompt_tokens,
                                                                     p.skip_special_tokens,
                                                                     p.spaces_between_special_tokens))
        self.model_runner.encoder_cache.hold(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.model_runner.encoder_cache.release(seq)
        del self.requests[seq.request_id]

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. With sampling_params.n > 1, step() outputs carry this id and, in
        outputs[0].index, which completion advanced; abort_request(id) stops them all."""
        seqs = self.make_sequences(prompt, sampling_params, request_id)
        for seq in seqs:
            self.add_sequence(seq)
        return seqs[0].parent_id

    def abort_request(self, request_id: str) -> bool:
        entry = self.requests.get(request_id)
        seqs = [entry[0]] if entry is not None else \
            [seq for seq, _ in list(self.requests.values()) if seq.parent_id == request_id]
        for seq in seqs:
            self._abort(seq)
        return bool(seqs)

    def _abort(self, seq: Sequence) -> None:
        self._finish(seq)
        seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduler + model step. Returns an output for every request that produced text or finished,
        with the cumulative text and tokens and, in delta_text / delta_token_ids, what this step added."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler could not place any waiting request; the KV pool is too small: raise "
                                   "kv_cache_bytes / memory_utilization or lower max_model_len")
            return []
        sampled = self.model_runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        outputs = []
        for seq, token_id, logprobs in sampled:
            outputs.append(self._append_token(seq, token_id, logprobs))
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, logprobs) -> RequestOutput:
        p = seq.sampling_params
        detok = self.requests[seq.request_id][1]
        seq.append_token(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        grammar_error = None
        if seq.grammar_matcher is not None:
            grammar_error = GrammarMatchers.accept(seq.grammar_matcher, token_id)
        sent = len(seq.output_text)
        # The sampler masks EOS and stop tokens until min_tokens, so one seen here past that point ends the request.
        is_stop_token = token_id in p.stop_token_ids or (token_id in self.eos_token_ids and not p.ignore_eos)
        stops = is_stop_token and seq.num_output_tokens > p.min_tokens
        if not stops or p.include_stop_str_in_output:  # vLLM leaves a stop token's text out unless asked for it
            seq.output_text += detok.step(seq.token_ids)
        if stops:
            seq.finish_reason = "stop"
            seq.stop_reason = token_id if token_id in p.stop_token_ids else None
        longest_stop = max(map(len, p.stop_strings), default=0)
        if seq.finish_reason is None and p.stop_strings and seq.num_output_tokens >= p.min_tokens:
            # Only text near the new piece can complete a stop string.
            window_start = max(0, sent - longest_stop)
            window = seq.output_text[window_start:]
            hits = [(window.find(s), s) for s in p.stop_strings if s in window]
            if hits:
                index, stop = min(hits)
                end = window_start + index + (len(stop) if p.include_stop_str_in_output else 0)
                seq.output_text = seq.output_text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (seq.num_output_tokens >= p.max_tokens or
                                          seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is None and grammar_error is not None:
            # Only when other options (allowed_token_ids, bad_words, min_tokens) left the grammar no token: the
            # output can no longer follow the constraint, so it ends here rather than run on unconstrained.
            logger.warning("request %s: its structured output constraint refused token %d (%s); aborted",
                           seq.request_id, token_id, grammar_error)
            seq.finish_reason = "abort"
        finished = seq.finish_reason is not None
        if finished:
            self._finish(seq)
        # While streaming, hold back text that could still turn out to be the start of a stop string (unless the
        # stop string is output too: then everything before its end is final).
        hold = 0 if finished or not p.stop_strings or p.include_stop_str_in_output else longest_stop - 1
        visible = max(len(seq.output_text) - hold, seq.num_streamed_chars)
        out = self.make_output(seq, finished)
        out.outputs[0].delta_text = seq.output_text[seq.num_streamed_chars:visible]
        out.outputs[0].delta_token_ids = [token_id]
        seq.num_streamed_chars = visible
        return out

    @staticmethod
    def make_output(seq: Sequence, finished: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None
            else None)
        return RequestOutput(request_id=seq.parent_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                             outputs=[completion], finished=finished, num_cached_tokens=seq.num_cached_tokens,
                             images=seq.images_info, videos=seq.videos_info)
