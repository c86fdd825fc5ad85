"""The engine loop: requests in, scheduler step, model step, incremental outputs out."""
import logging
import time
from itertools import count

import torch

from vlinfer import model_loader, ops, platform
from vlinfer.config import MAX_FITTED_BATCHED_TOKENS, MIN_BATCHED_TOKENS, EngineConfig
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

logger = logging.getLogger("vlinfer")

PromptType = str | list[int] | dict


def check_tensor_parallel_shapes(text_config, tp: int) -> None:
    """Query heads and the MLP split evenly; KV heads split evenly or, when fewer than ranks, replicate."""
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
        self.source = model_loader.resolve_model(model)
        self.device = platform.resolve_device(config.device)
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
            config.max_num_batched_tokens = self._default_batched_tokens(fit_model_len)
        if config.kvcache_block_size is None:
            config.kvcache_block_size = platform.default_block_size(self.device)
        torch.manual_seed(config.seed)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        get_model_class(self.hf_config)  # an unsupported architecture fails here, before the workers load
        check_tensor_parallel_shapes(self.text_config, config.tensor_parallel_size)
        self._build(config)
        if fit_model_len:
            self._fit_max_model_len(model_len)
            if fit_batched_tokens:
                config.max_num_batched_tokens = self._default_batched_tokens(fit_model_len)
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
        self.model_context = ModelContext(ops.select(self.device.type, forced=config.ops), group)
        net = load_model(self.source, self.hf_config, self.device, self.dtype, self.model_context)
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
        self.model_runner = ModelRunner(config, self.hf_config, net, self.model_context, self.device, self.dtype,
                                        self.eos_token_ids, self.driver)
        num_blocks = self.model_runner.num_blocks_for_budget(self.max_model_len)
        self.model_runner.allocate_kv_cache(num_blocks)
        self.model_runner.capture_graphs(self.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB%s, %d tokens)", num_blocks, config.kvcache_block_size,
                    num_blocks * self.model_runner.bytes_per_block / 2 ** 20,
                    " per rank" if self.driver is not None else "", num_blocks * config.kvcache_block_size)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)

    def _default_batched_tokens(self, fitted: bool) -> int:
        """max_num_batched_tokens when not given: a full-length prompt per step; for a fitted length, bounded
        (config.MAX_FITTED_BATCHED_TOKENS says why)."""
        tokens = min(self.max_model_len, MAX_FITTED_BATCHED_TOKENS) if fitted else self.max_model_len
        return max(tokens, MIN_BATCHED_TOKENS)

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
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], dict]:
        """(prompt text, token ids, extra request fields) for any accepted prompt form; ValueError otherwise."""
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
            unknown = set(mm_data) - {"image"}
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys {sorted(unknown)}; only 'image' is supported")
            images = mm_data.get("image", [])
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            mm_kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
            processed = self.input_processor.process(token_ids, images, mm_kwargs)
            token_ids = processed.token_ids
            extra = {"mm_items": processed.mm_items, "mrope_positions": processed.mrope_positions,
                     "mrope_position_delta": processed.mrope_position_delta, "images_info": processed.images}
        vocab = self.text_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary range [0, {vocab}): {bad[:5]}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        return text, token_ids, extra

    def make_sequence(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """Validate a request and build its Sequence without touching engine state."""
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        text, token_ids, extra = self.process_prompt(prompt)
        if request_id is None:
            request_id = str(next(self._request_ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Every request samples from its own generator: seeded ones from their seed, others from a seed
        # drawn from the engine's seed, so runs repeat and batch composition never changes a draw.
        seed = sampling_params.seed
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (), generator=self._seed_source))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        images_info = extra.pop("images_info", [])
        seq = Sequence(token_ids, sampling_params, request_id=request_id, prompt=text, generator=generator, **extra)
        seq.images_info = images_info
        return seq

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, mm_processor_kwargs: dict | None = None) -> dict:
        """One conversation (OpenAI-style content parts allowed) -> a prompt dict for add_request / generate."""
        from vlinfer.multimodal.chat import message_texts, split_chat_images
        template_messages, images = split_chat_images(messages)
        if images and not self.is_multimodal:
            raise ValueError(f"model {self.source.name!r} is a text-only model and does not accept images")
        if self.is_multimodal:
            for text in message_texts(template_messages):
                self.input_processor.check_user_text(text)
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"model {self.source.name!r} has no chat template; pass chat_template=")
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, chat_template=template,
                                                  add_generation_prompt=add_generation_prompt)
        prompt = {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        if mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return prompt

    def add_sequence(self, seq: Sequence) -> str:
        self.requests[seq.request_id] = (seq, IncrementalDetokenizer(self.tokenizer, seq.num_prompt_tokens))
        self.model_runner.encoder_cache.hold(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.model_runner.encoder_cache.release(seq)
        del self.requests[seq.request_id]

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.add_sequence(self.make_sequence(prompt, sampling_params, request_id))

    def abort_request(self, request_id: str) -> bool:
        entry = self.requests.get(request_id)
        if entry is None:
            return False
        seq = entry[0]
        self._finish(seq)
        seq.finish_reason = "abort"
        return True

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
                raise RuntimeError("scheduler could not place any waiting request; the KV pool is too small")
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
        sent = len(seq.output_text)
        seq.output_text += detok.step(seq.token_ids)
        # The sampler masks EOS and stop tokens until min_tokens, so one seen here past that point ends the request.
        is_stop_token = token_id in p.stop_token_ids or (token_id in self.eos_token_ids and not p.ignore_eos)
        if is_stop_token and seq.num_output_tokens > p.min_tokens:
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
                seq.output_text = seq.output_text[:window_start + index]
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (seq.num_output_tokens >= p.max_tokens or
                                          seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        if finished:
            self._finish(seq)
        # While streaming, hold back text that could still turn out to be the start of a stop string.
        hold = 0 if finished or not p.stop_strings else longest_stop - 1
        visible = max(len(seq.output_text) - hold, seq.num_streamed_chars)
        out = self.make_output(seq, finished)
        out.outputs[0].delta_text = seq.output_text[seq.num_streamed_chars:visible]
        out.outputs[0].delta_token_ids = [token_id]
        seq.num_streamed_chars = visible
        return out

    @staticmethod
    def make_output(seq: Sequence, finished: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=seq.output_text, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None
            else None)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                             outputs=[completion], finished=finished, num_cached_tokens=seq.num_cached_tokens,
                             images=seq.images_info)
