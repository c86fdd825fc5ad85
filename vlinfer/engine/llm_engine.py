"""The engine: requests in (input_processor.py), scheduler step, model step (model_runner.py),
incremental outputs out (output_processor.py). Built once: config and tokenizer, the model, the KV
pool and context length resolved into one frozen ResolvedConfig (sizing.py)."""
import logging
import time
from itertools import count

from vlinfer import loading, platform
from vlinfer.config import EngineConfig, ResolvedConfig
from vlinfer.distributed import ParallelConfig, TPDriver, check_tensor_parallel_shapes
from vlinfer.engine import sizing
from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.build_runner import build_runner
from vlinfer.engine.input_processor import InputProcessor
from vlinfer.engine.output_processor import OutputProcessor
from vlinfer.engine.pooling import resolve_pooling
from vlinfer.engine.scheduler import Scheduler
from vlinfer.engine.sequence import Sequence
from vlinfer.engine.speculative import DraftModel, Speculator, placeholder_token_ids
from vlinfer.engine.worker import spawned_worker_main
from vlinfer.inputs import PromptType
from vlinfer.layers.distributed import SINGLE
from vlinfer.models import SupportsMultiModal, get_model_class
from vlinfer.outputs import PoolingRequestOutput, RequestOutput
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams
from vlinfer.structured.matchers import GrammarMatchers
from vlinfer.vllm_names import engine_config

logger = logging.getLogger("vlinfer")


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = engine_config(model, **kwargs)  # vLLM's keywords too (vllm_names.py)
        parallel = ParallelConfig.of(config)
        if parallel.launched_externally and parallel.rank != 0:
            # torchrun ran this script on every rank: this one serves rank 0's engine, then exits
            from vlinfer.engine.worker import serve_from_env
            serve_from_env(parallel)  # does not return
        self.config = config
        self.driver: TPDriver | None = None
        self.grammar_matchers: GrammarMatchers | None = None  # close() may run before _build
        self.device = platform.resolve_device(config.device)  # fails before any model work
        self.source = loading.resolve_model(model)
        self.hf_config = loading.load_config(self.source, config.hf_overrides)
        check_tensor_parallel_shapes(self.hf_config.get_text_config(), config.tensor_parallel_size,
                                     config.enable_expert_parallel,
                                     config.speculative_config is not None)
        if config.tensor_parallel_size > 1:  # spawned after the shape check, from config.json
            self.driver = TPDriver(parallel, self.device.type, spawned_worker_main)
            self.device = self.driver.device
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.tokenizer = loading.load_tokenizer(self.source)
        self.dtype = platform.resolve_dtype(config.dtype, self.hf_config, self.device)
        self.text_config = self.hf_config.get_text_config()  # nested in multimodal configs
        model_len, longest = sizing.context_limit(config, self.text_config)  # before any weight
        get_model_class(self.hf_config)  # an unsupported architecture fails before workers load
        # A pooling engine generates too where its checkpoint has an LM head (both kinds batch).
        tensors = loading.checkpoint_tensor_index(self.source, self.hf_config)
        self.pooling, self.can_generate = resolve_pooling(config, self.source, self.hf_config,
                                                          self.tokenizer, tensors)
        block_size = sizing.block_size(config, self.device)
        kv_cache_dtype = sizing.kv_cache_dtype(config, self.dtype, self.hf_config,
                                               self.source.folder)
        group = SINGLE
        if self.driver is not None:  # the workers load their shards while rank 0 loads its own
            self.driver.start_workers(
                {"source": self.source, "hf_config": self.hf_config, "config": config,
                 "dtype": self.dtype, "kv_cache_dtype": kv_cache_dtype, "pooling": self.pooling,
                 "device_type": self.device.type, "block_size": block_size})
            group = self.driver.group
        self.eos_token_ids = loading.eos_token_ids(self.source, self.tokenizer)
        # Structured outputs over the logits' width; built when a request is constrained.
        self.grammar_matchers = GrammarMatchers(self.tokenizer, self.text_config.vocab_size,
                                                self.eos_token_ids)
        self.model_runner = runner = build_runner(
            config, self.source, self.hf_config, self.device, block_size, ops_choice=config.ops,
            dtype=self.dtype, kv_cache_dtype=kv_cache_dtype, group=group,
            expert_parallel=config.enable_expert_parallel, quantization=config.quantization,
            pooling=self.pooling, tensors=tensors, eos_token_ids=self.eos_token_ids,
            driver=self.driver, grammar_matchers=self.grammar_matchers)
        logger.info("loaded %s (%s) on %s in %s in %.1fs%s", self.source.name,
                    type(runner.model).__name__, self.device, self.dtype,
                    time.perf_counter() - start,
                    f", tensor parallel over {group.size} ranks" if group.size > 1 else "")
        self.model_context, self.ops_implementation = runner.ctx, runner.ctx.ops.name
        ranks_per_host = self.driver.local_world_size if self.driver is not None else 1
        # Before sizing: the draft's KV pool takes its share of the same budget.
        draft = DraftModel.load(config.speculative_config, self.text_config.vocab_size, self.device,
                                config.ops, self.dtype, block_size, config.max_num_seqs)
        self.resolved: ResolvedConfig = sizing.resolve(
            config, self.dtype, model_len, longest, block_size, runner, ranks_per_host, draft)
        self.model_runner.init_cache(self.resolved)  # the pool, then graphs over its addresses
        if draft is not None:  # as many blocks as the target's pool
            draft.allocate_kv_cache(self.resolved.num_blocks)
        self.block_manager = BlockManager(self.resolved.num_blocks, block_size,
                                          self.resolved.enable_prefix_caching,
                                          self.resolved.num_state_slots,
                                          self.resolved.num_checkpoint_slots)
        self.scheduler = Scheduler(self.block_manager, self.resolved.max_num_seqs,
                                   self.resolved.max_num_batched_tokens,
                                   config.max_loras if config.enable_lora else 0)
        self.speculator = Speculator(config.speculative_config, self.resolved.max_model_len,
                                     placeholder_token_ids(self.hf_config), draft, runner.mtp)
        self.input_processor = InputProcessor.of_model(
            self.source, self.hf_config, self.tokenizer, self.device, self.resolved.max_model_len,
            isinstance(runner.model, SupportsMultiModal), config.allow_image_urls,
            self.grammar_matchers, config.seed, self.pooling, self.can_generate, runner.lora,
            config.language_model_only, config.reasoning_parser)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                self.resolved.max_model_len)
        self.requests: dict[str, Sequence] = {}  # by sequence id: added and not yet finished
        self._request_ids = count()

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    @property
    def is_multimodal(self) -> bool:  # a model with a vision tower
        return self.input_processor.is_multimodal

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one rank); also at interpreter exit."""
        if self.grammar_matchers is not None:
            self.grammar_matchers.close()
        if self.driver is not None:
            self.driver.close()

    # ---- requests ----
    def make_sequences(self, prompt: PromptType,
                       sampling_params: SamplingParams | PoolingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> list[Sequence]:
        """Validate a request; build its n Sequences (one with PoolingParams), no state touched."""
        if request_id is None:
            request_id = str(next(self._request_ids))
        n = sampling_params.n if isinstance(sampling_params, SamplingParams) else 1
        if any(i in self.requests
               for i in {request_id, f"{request_id}#0", *(f"{request_id}#{k}" for k in range(n))}):
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.input_processor.make_sequences(prompt, sampling_params, request_id,
                                                   lora_request)

    def make_sequence(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """make_sequences for callers that queue one sequence per request (the engine loop)."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(
                f"SamplingParams.n={sampling_params.n}: this call makes one completion; "
                "LLM.generate, LLM.chat and LLMEngine.add_request run n")
        return self.make_sequences(prompt, sampling_params, request_id)[0]

    def chat_prompt(self, messages: list[dict], *args, **kwargs) -> dict:
        return self.input_processor.chat_prompt(messages, *args, **kwargs)

    def add_sequence(self, seq: Sequence) -> str:
        self.requests[seq.request_id] = seq
        self.output_processor.add(seq)
        self.model_runner.encoder_cache.hold(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request=None) -> str:
        """Queue a request; returns its id. With sampling_params.n > 1, step() outputs carry this id
        and, in outputs[0].index, which completion advanced; abort_request(id) stops them all."""
        seqs = self.make_sequences(prompt, sampling_params, request_id, lora_request)
        for seq in seqs:
            self.add_sequence(seq)
        return seqs[0].parent_id

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        seqs = [seq] if seq is not None else [s for s in list(self.requests.values())
                                              if s.parent_id == request_id]
        for seq in seqs:
            self._finish(seq)
            seq.finish_reason = "abort"
        return bool(seqs)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.model_runner.encoder_cache.release(seq)
        self.speculator.release(seq)  # its draft model's KV, if any
        self.output_processor.remove(seq)
        del self.requests[seq.request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # ---- the loop ----
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One scheduler + model step. Returns an output for every request that produced text or
        finished, with the cumulative text and tokens and, in delta_text / delta_token_ids, what
        this step added (a PoolingRequestOutput once a pooling request's prompt is in)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler could not place any waiting request; the KV pool is "
                                   "too small: raise kv_cache_bytes / memory_utilization or lower "
                                   "max_model_len")
            return []
        now = time.time()
        for seq in batch.seqs:
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        self.scheduler.add_proposals(batch, self.speculator.propose(batch, self.scheduler.reserve))
        sampled, prompt_logprobs, pooled = self.model_runner.execute(batch)
        for seq, position, entry in prompt_logprobs:
            self.output_processor.add_prompt_logprob(seq, position, entry)
        outputs = [self.pooling.request_output(seq, row) for seq, row in pooled]
        outputs += [self.output_processor.append_tokens(seq, tokens, logprobs)
                    for seq, tokens, logprobs in sampled]
        self.speculator.record(sampled)  # acceptance, before update rolls back the rejected
        self.scheduler.update(batch, sampled)
        finished = [seq for seq, *_ in sampled if seq.finish_reason is not None]
        for seq in [seq for seq, _ in pooled] + finished:
            self._finish(seq)
        return outputs
