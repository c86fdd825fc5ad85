"""The offline entry point, shaped like vLLM's `LLM` so its users can switch."""
from tqdm.auto import tqdm

from vlinfer.engine.llm_engine import LLMEngine, PromptType
from vlinfer.outputs import RequestError, RequestOutput
from vlinfer.sampling_params import SamplingParams


class LLM:
    """tensor_parallel_size=N splits the model over N ranks: rank 0 in this process, the others in spawned worker
    processes (or started by torchrun; see vlinfer/engine/worker.py). They stop on close(), at the end of a
    `with LLM(...) as llm:` block, when the LLM is garbage collected, and at interpreter exit."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order. A request that cannot be run (bad prompt,
        bad image, bad sampling_params) does not stop the others: after they finish, RequestError (a ValueError)
        names each rejected request and carries every output in `.outputs`."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                 all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        seqs, order = [], {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                seq = self.engine.make_sequence(prompt, params)
            except ValueError as e:  # a bad request is answered with its error; the others still run
                results[i] = RequestOutput.rejected(f"rejected-{i}", prompt, str(e))
                continue
            seqs.append(seq)
            order[seq.request_id] = i
        self._run(seqs, order, results, use_tqdm)
        if any(r.error for r in results):
            raise RequestError(results)
        return results

    def _run(self, seqs, order: dict[str, int], results: list, use_tqdm: bool) -> None:
        for seq in seqs:
            self.engine.add_sequence(seq)
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for seq in seqs:  # a failed or interrupted run must not leave its requests holding blocks
                self.engine.abort_request(seq.request_id)
            raise
        finally:
            bar.close()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template, then generate. Takes one conversation or a list of them; content may be
        a string or OpenAI-style parts ({"type": "text"}, {"type": "image", "image": ...},
        {"type": "image_url", "image_url": {"url": ...}})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.chat_prompt(c, add_generation_prompt, chat_template, mm_processor_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
