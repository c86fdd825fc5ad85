"""The offline entry point, shaped like vLLM's `LLM` so its users can switch."""
from tqdm.auto import tqdm

from vlinfer.engine.llm_engine import LLMEngine, PromptType
from vlinfer.outputs import RequestOutput
from vlinfer.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order. Every prompt is validated before any
        is queued, so a bad one raises ValueError and leaves the engine as it was."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                 all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        return self._run(seqs, use_tqdm)

    def _run(self, seqs, use_tqdm: bool) -> list[RequestOutput]:
        for seq in seqs:
            self.engine.add_sequence(seq)
        order = {seq.request_id: i for i, seq in enumerate(seqs)}
        results: list[RequestOutput | None] = [None] * len(seqs)
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
        return results

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
