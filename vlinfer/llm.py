"""The offline entry point, shaped like vLLM's `LLM` so its users can switch."""
import dataclasses
import logging
from collections import Counter

from tqdm.auto import tqdm

from vlinfer.engine.drive import drive
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.inputs import PromptType
from vlinfer.inputs.retrieval import RERANK_FORMATS, mm_processor_kwargs
from vlinfer.outputs import PoolingRequestOutput, RequestError, RequestOutput, ScoringOutput
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams

logger = logging.getLogger("vlinfer")


class LLM:
    """tensor_parallel_size=N splits the model over N ranks: rank 0 in this process, the others in
    spawned worker processes (or started by torchrun; see vlinfer/engine/worker.py). They stop on
    close(), at the end of a `with LLM(...) as llm:` block, when the LLM is garbage collected, and
    at interpreter exit."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drop every cached KV block, so the next requests compute their prompts afresh.
        Only while no request runs (False otherwise)."""
        return self.engine.scheduler.reset_prefix_cache()

    def get_tokenizer(self):
        """The engine's tokenizer (a transformers tokenizer), as vLLM's LLM.get_tokenizer: chat
        templates, counts."""
        return self.tokenizer

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order. A request that cannot be run
        (bad prompt, bad image, bad sampling_params) does not stop the others: after they finish,
        RequestError (a ValueError) names each rejected request and carries every output in
        `.outputs`. lora_request: a LoRARequest for every prompt, or a list of one (or None) per
        prompt (needs LLM(..., enable_lora=True))."""
        prompts = _prompt_list(prompts)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        loras = _lora_per_prompt(lora_request, len(prompts))
        results: list[RequestOutput | None] = [None] * len(prompts)
        seqs, order = [], {}
        for i, (prompt, params, lora) in enumerate(zip(prompts, sampling_params, loras)):
            try:
                # n sequences for n completions
                group = self.engine.make_sequences(prompt, params, lora_request=lora)
            # a bad request is answered with its error; the others still run
            except ValueError as e:
                results[i] = RequestOutput.rejected(f"rejected-{i}", prompt, str(e))
                continue
            seqs.extend(group)
            order[group[0].parent_id] = i
        self._run(seqs, order, results, use_tqdm)
        if any(r.error for r in results):
            raise RequestError(results)
        return results

    def _run(self, seqs, order: dict[str, int], results: list, use_tqdm: bool) -> None:
        for seq in seqs:
            self.engine.add_sequence(seq)
        sizes = Counter(seq.parent_id for seq in seqs)  # completions per request
        done: dict[str, list[RequestOutput]] = {}
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm, unit="req")
        try:  # a failed or interrupted run aborts its requests (drive): none is left holding blocks
            for out in drive(self.engine, order):
                if out.finished:
                    finished = done.setdefault(out.request_id, [])
                    finished.append(out)
                    if len(finished) == sizes[out.request_id]:
                        results[order[out.request_id]] = _merge(finished)
                        bar.update(1)
        finally:
            bar.close()

    # ---- pooling (runner="pooling"): prefill only, a vector or a score per request;
    # engine/pooling.py ----
    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
               use_tqdm: bool = True, pooling_task: str | None = None,
               lora_request=None) -> list[PoolingRequestOutput]:
        """The pooled data of each prompt (`.outputs.data`): the embedding, or the classifier's
        probabilities. Rejected prompts are answered as generate answers them: RequestError after
        the others finished. lora_request as in generate."""
        prompts = _prompt_list(prompts)
        loras = _lora_per_prompt(lora_request, len(prompts))
        if not isinstance(pooling_params, list):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        if pooling_task is not None:
            pooling_params = [dataclasses.replace(p, task=pooling_task) for p in pooling_params]
        if self.engine.pooling is not None:  # wrong for every prompt alike: said once, not per item
            for params in {id(p): p for p in pooling_params}.values():
                self.engine.pooling.check(params, self.engine.input_processor.model_name)
        results: list = [None] * len(prompts)
        seqs, order = [], {}
        for i, (prompt, params, lora) in enumerate(zip(prompts, pooling_params, loras)):
            try:
                seq = self.engine.make_sequences(prompt, params, lora_request=lora)[0]
            except ValueError as e:
                results[i] = PoolingRequestOutput.rejected(f"rejected-{i}", str(e))
                continue
            seqs.append(seq)
            order[seq.request_id] = i
            self._warn_unknown_tokens(seq)
        self._run(seqs, order, results, use_tqdm)
        if any(r.error for r in results):
            raise RequestError(results)
        return results

    def _warn_unknown_tokens(self, seq) -> None:
        """On an embedded toy, a prompt's tokens it has no learned row for add nothing to the vector
        (their rows are zero): said, not left to a silent near-zero score."""
        source = self.engine.source
        if not (source.embedded and source.max_tokens):  # the trained toys: they set max_tokens
            return
        from vlinfer.toy.embedded import known_token_ids
        known = known_token_ids(embedder=self.engine.pooling.task == "embed")
        unknown = [t for t in seq.prompt_token_ids if t not in known]
        if unknown:
            words = self.engine.tokenizer.decode(unknown)
            logger.warning("%s: %d token(s) of this prompt are outside the toy's vocabulary (%r), "
                           "so they add nothing to its vector; it knows only its drawn world's "
                           "words", source.name, len(unknown), words[:80])

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None,
              lora_request=None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), L2-normalized;
        PoolingParams(dimensions=k) keeps the leading k (Matryoshka) and normalizes again. Prompts
        are taken as given, as vLLM does: for the Qwen embedder's instruction format use
        Pipeline.embed or vlinfer.inputs.retrieval.embedding_messages."""
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.encode(prompts, dataclasses.replace(params, task="embed"), use_tqdm,
                           lora_request=lora_request)

    def classify(self, prompts, use_tqdm: bool = True,
                 lora_request=None) -> list[PoolingRequestOutput]:
        """A classifier's probabilities per prompt (`.outputs.probs`); the Qwen rerankers give
        [P(yes)]."""
        return self.encode(prompts, PoolingParams(task="classify"), use_tqdm,
                           lora_request=lora_request)

    def score(self, data_1, data_2, use_tqdm: bool = True, instruction: str | None = None,
              pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """vLLM's score: one query against each document (data_1 one item, data_2 a list), or pairs
        (two lists of one length); `.outputs.score` per pair. A reranker reads each pair in its own
        format (inputs/retrieval.py, with `instruction`); an embedder gives the cosine of the two
        embeddings of the items taken as given. Items: a string, or a dict with "text" / "image" /
        "video"."""
        firsts, seconds = score_pairs(data_1, data_2)
        pooling = self.engine.pooling
        if pooling is not None and pooling.task == "classify":
            prompts, rejected = [], {}
            for i, (query, document) in enumerate(zip(firsts, seconds)):
                try:
                    prompts.append(rerank_prompt(self.engine, query, document, instruction))
                except ValueError as e:
                    rejected[i] = PoolingRequestOutput.rejected(f"rejected-{i}", str(e))
                    prompts.append(None)
            return self._with_rejected(prompts, rejected, PoolingParams(task="score"), use_tqdm)
        if instruction is not None:
            raise ValueError(
                "instruction= is for a reranker; an embedder scores the items as given")
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        items = [_embedding_prompt(x) for x in firsts + seconds]
        vectors = self._with_rejected(items, {}, params, use_tqdm)
        n = len(firsts)
        out = []
        for i, (a, b) in enumerate(zip(vectors[:n], vectors[n:])):
            out.append(
                PoolingRequestOutput(f"score-{i}", ScoringOutput(cosine(a, b, params)),
                                     a.prompt_token_ids + b.prompt_token_ids))
        return out

    def _with_rejected(self, prompts: list, rejected: dict, params: PoolingParams,
                       use_tqdm: bool) -> list:
        """encode() over the prompts that could be built; the ones that could not keep their index's
        error."""
        keep = [i for i in range(len(prompts)) if i not in rejected]
        try:
            outputs = self.encode([prompts[i] for i in keep], params, use_tqdm) if keep else []
            failed = bool(rejected)
        except RequestError as e:
            outputs, failed = e.outputs, True
        results = dict(rejected)
        results.update(zip(keep, outputs))
        results = [results[i] for i in range(len(prompts))]
        if failed:
            raise RequestError(results)
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             mm_processor_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request=None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template, then generate. Takes one conversation or a list of them;
        content may be a string or OpenAI-style parts ({"type": "text"}, {"type": "image", "image":
        ...}, {"type": "image_url", "image_url": {"url": ...}}). tools: OpenAI tool definitions,
        rendered by the chat template as vLLM's chat(tools=...) does; the calls the model writes
        stay in the text. chat_template_kwargs: more template variables, as vLLM's, e.g.
        {"enable_thinking": False}. Bad conversations are answered as generate answers bad prompts:
        RequestError after the others finished, every output in `.outputs` in input order."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # As in generate, a conversation that cannot be run (vision tokens typed in its text, an
        # unknown content part, a message that is not a dict) is answered with its error and the
        # others still run.
        prompts, rejected = {}, {}
        for i, conversation in enumerate(conversations):
            try:
                prompts[i] = self.engine.chat_prompt(conversation, add_generation_prompt,
                                                     chat_template, mm_processor_kwargs, tools,
                                                     chat_template_kwargs)
            except ValueError as e:
                rejected[i] = RequestOutput.rejected(f"rejected-{i}", None, str(e))
        if not rejected:
            return self.generate(list(prompts.values()), sampling_params, use_tqdm, lora_request)
        for name, value in (("sampling_params", sampling_params), ("lora_request", lora_request)):
            if isinstance(value, list) and len(value) != len(conversations):
                raise ValueError(f"got {len(value)} {name} for {len(conversations)} conversations")
        # one per conversation: keep those of the ones that run
        if isinstance(sampling_params, list):
            sampling_params = [sampling_params[i] for i in prompts]
        if isinstance(lora_request, list):
            lora_request = [lora_request[i] for i in prompts]
        try:
            outputs = self.generate(list(prompts.values()), sampling_params, use_tqdm,
                                    lora_request) if prompts else []
        # rejected by generate: the conversation's own index names it below
        except RequestError as e:
            outputs = e.outputs
        results = dict(rejected)
        for i, out in zip(prompts, outputs):
            results[i] = RequestOutput.rejected(f"rejected-{i}", out.prompt,
                                                out.error) if out.error else out
        raise RequestError([results[i] for i in range(len(conversations))])


def score_pairs(data_1, data_2) -> tuple[list, list]:
    """vLLM's score pairing (LLM.score, the server's /score and /rerank): one item against each of a
    list, or two lists of one length, as two lists of one length."""
    firsts = data_1 if isinstance(data_1, list) else [data_1]
    seconds = data_2 if isinstance(data_2, list) else [data_2]
    if not seconds or len(firsts) not in (1, len(seconds)):
        raise ValueError(f"score takes one item against a list, or two lists of one length; got "
                         f"{len(firsts)} and {len(seconds)}")
    return firsts * len(seconds) if len(firsts) == 1 else firsts, seconds


def rerank_prompt(engine, query, document, instruction: str | None = None) -> dict:
    """A reranker's (query, document) pair as its prompt: the conversation of its model source's
    format (inputs/retrieval.py RERANK_FORMATS: the Qwen reranker's, or the embedded toy's
    question), media sized as the Qwen code sizes them."""
    messages = RERANK_FORMATS[engine.source.rerank_format](query, document, instruction)
    return engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs(messages))


def cosine(a: PoolingRequestOutput, b: PoolingRequestOutput, params: PoolingParams) -> float:
    """An embedder's score of two embedding outputs: their dot product, divided by their norms
    unless the embeddings are normalized already (PoolingParams.normalize not False)."""
    x, y = a.outputs.embedding, b.outputs.embedding
    dot = sum(p * q for p, q in zip(x, y))
    if params.normalize is False:
        dot /= (sum(p * p for p in x) * sum(q * q for q in y)) ** 0.5
    return clamp_cosine(dot)


def clamp_cosine(value: float) -> float:
    """A cosine within [-1, 1]: float rounding of unit vectors' dot product may pass 1 by an ulp."""
    return max(-1.0, min(1.0, value))


def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a list of token ids) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                             all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)


def _lora_per_prompt(lora_request, n: int) -> list:
    """One LoRARequest (or None) for every prompt, or a list of one per prompt -> a list of n."""
    loras = lora_request if isinstance(lora_request, list) else [lora_request] * n
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
    return loras


def _embedding_prompt(item):
    """An embedder's score item: a string as given, or a dict with "text" only (media go through
    LLM.embed's prompt dicts or Pipeline.embed)."""
    if isinstance(item, dict) and set(item) == {"text"}:
        return item["text"]
    return item


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput per request, as vLLM returns: its n completions in index order."""
    if len(outputs) == 1:
        return outputs[0]
    outputs = sorted(outputs, key=lambda out: out.outputs[0].index)
    return dataclasses.replace(outputs[0], outputs=[out.outputs[0] for out in outputs],
                               finished=True)
