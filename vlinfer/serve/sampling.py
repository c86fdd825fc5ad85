"""Request -> SamplingParams, one mapping for both APIs (chat and text completions): unset fields
keep SamplingParams' (vLLM's) defaults, set ones are checked there, and a bad one is a 400 naming
the field."""
import re

from vlinfer.sampling_params import SamplingParams
from vlinfer.serve.constraints import output_constraint
from vlinfer.serve.errors import ApiError
from vlinfer.serve.protocol import MAX_STOP_SEQUENCES


def _sampling_error(e: ValueError) -> ApiError:
    text = str(e)
    m = re.match(r"SamplingParams\.(\w+) ", text)
    return ApiError(400, text.replace("SamplingParams.", ""), param=m.group(1) if m else None,
                    code="invalid_value")


def request_params(req, logprobs: int | None, max_model_len: int, disable_any_whitespace: bool,
                   tag_ids: tuple[int | None, int | None] = (None, None),
                   max_tokens_default: int | None = None) -> SamplingParams:
    """A chat or completion request's SamplingParams; max_tokens unset is max_tokens_default (the
    server's --max-tokens-default), else the room left in the context (vLLM's rule)."""
    options = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                   presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                   repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                   ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids, seed=req.seed,
                   logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                   spaces_between_special_tokens=req.spaces_between_special_tokens,
                   include_stop_str_in_output=req.include_stop_str_in_output,
                   truncate_prompt_tokens=req.truncate_prompt_tokens, logit_bias=req.logit_bias,
                   allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                   thinking_token_budget=req.thinking_token_budget,
                   structured_outputs=output_constraint(req, disable_any_whitespace, tag_ids))
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_SEQUENCES:
        raise ApiError(400,
                       f"stop has {len(req.stop)} sequences; the limit is {MAX_STOP_SEQUENCES}",
                       param="stop")
    if req.stop:
        options["stop"] = req.stop
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    # Unset: the server's default, else the room left in the context; the engine stops at the
    # context's end with finish_reason "length" either way.
    options["max_tokens"] = max_tokens or max_tokens_default or max_model_len
    try:
        return SamplingParams(**options)
    except ValueError as e:
        raise _sampling_error(e) from None
