"""vLLM's documented offline idioms, written as vLLM's docs and examples write them with only the
import changed (`from vllm import ...` -> `from vlinfer import ...`), on the real SmolLM2 and the
embedded tiny Qwen3-VL. What vLLM offers and vlinfer does not is listed in README.md ("vLLM's LLM
surface")."""
import json
import re
from enum import Enum

import numpy as np
import pytest
from PIL import Image
from pydantic import BaseModel

from vlinfer import LLM, SamplingParams
from vlinfer.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2", max_model_len=1024, kv_cache_bytes=64 * 2 ** 20)


@pytest.fixture(scope="module")
def vlm():
    return LLM(model="qwen3-vl-tiny", max_model_len=2048, kv_cache_bytes=64 * 2 ** 20)


def test_generate_prompts_with_sampling_params(llm):
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)
    outputs = llm.generate(prompts=prompts, sampling_params=sampling_params)
    assert [output.prompt for output in outputs] == prompts
    for output in outputs:
        generated_text = output.outputs[0].text
        assert output.finished and generated_text and len(output.outputs[0].token_ids) <= 16


def test_chat_with_a_system_turn(llm):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    outputs = llm.chat(conversation, sampling_params=SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text
    # The chat template through get_tokenizer, as vLLM users build prompts themselves: the same
    # prompt tokens.
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    assert again[0].prompt_token_ids == outputs[0].prompt_token_ids
    assert again[0].outputs[0].text == outputs[0].outputs[0].text


def test_tokens_prompt_dicts(llm):
    token_ids = llm.get_tokenizer()("The capital of France is").input_ids
    by_tokens = llm.generate([{"prompt_token_ids": token_ids}],
                             SamplingParams(temperature=0, max_tokens=8))[0]
    by_text = llm.generate({"prompt": "The capital of France is"},
                           SamplingParams(temperature=0, max_tokens=8))[0]
    assert by_tokens.prompt_token_ids == token_ids == by_text.prompt_token_ids
    assert by_tokens.outputs[0].text == by_text.outputs[0].text


def test_logprobs_and_prompt_logprobs_read_as_objects(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    output = llm.generate("The capital of France is", params)[0]
    completion = output.outputs[0]
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token_id].rank == 1 and entry[token_id].logprob <= 0
        assert entry[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
    assert output.prompt_logprobs[0] is None
    for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in entry and 1 <= len(entry) <= 2 and entry[token_id].rank >= 1


def test_n_with_seed(llm):
    params = SamplingParams(n=3, seed=42, temperature=0.8, max_tokens=12)
    first, second = (llm.generate("Tell me a story.", params)[0] for _ in range(2))
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    assert len({c.text for c in first.outputs}) > 1


def test_structured_outputs_example(llm):
    """vLLM's structured-outputs example: choice, regex, JSON from a pydantic model, the SQL EBNF
    grammar."""
    choice = StructuredOutputsParams(choice=["Positive", "Negative"])
    out = llm.generate(prompts="Classify this sentiment: vLLM is wonderful!",
                       sampling_params=SamplingParams(structured_outputs=choice))
    assert out[0].outputs[0].text in ("Positive", "Negative")

    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"),
                           stop=["\n"], temperature=0, max_tokens=40)
    out = llm.generate(
        prompts="Generate an email address for Alan Turing, who works in Enigma. End in .com and "
        "new line. Example result: alan.turing@enigma.com\n", sampling_params=regex)
    text = out[0].outputs[0].text
    assert text.isascii() and re.fullmatch(r"[A-Za-z0-9_]+(@[A-Za-z0-9_]*(\.(c(om?)?)?)?)?",
                                           text), text

    class CarType(str, Enum):
        sedan = "sedan"
        suv = "SUV"
        truck = "Truck"
        coupe = "Coupe"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    json_params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=CarDescription.model_json_schema(),
                                                   disable_any_whitespace=True), temperature=0,
        max_tokens=60)
    out = llm.generate(
        prompts="Generate a JSON with the brand, model and car_type of the most iconic car from "
                "the "
        "90's", sampling_params=json_params)
    if out[0].outputs[0].finish_reason == "stop":
        CarDescription.model_validate(json.loads(out[0].outputs[0].text))
    else:  # cut by max_tokens: what is there is the start of such an object
        assert out[0].outputs[0].text.startswith('{"brand":"'), out[0].outputs[0].text

    simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    out = llm.generate(
        prompts="Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
        sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(grammar=simplified_sql_grammar),
            temperature=0, max_tokens=40))
    sql = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "
    assert re.fullmatch(sql, out[0].outputs[0].text), out[0].outputs[0].text


def test_multi_modal_data_image_and_video(vlm):
    """vLLM's multimodal prompt dicts: the Qwen3-VL placeholders in the prompt text, the media in
    multi_modal_data (a PIL image; a video as a frames array)."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the image?" \
             "<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0, max_tokens=4)
    out = vlm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                       sampling_params=params)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.images[0]["num_tokens"] > 0
    frames = np.random.default_rng(1).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    prompt = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe the video." \
             "<|im_end|>\n<|im_start|>assistant\n"
    out = vlm.generate({"prompt": prompt, "multi_modal_data": {"video": frames}},
                       sampling_params=params)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.videos[0]["num_tokens"] > 0


def test_chat_with_tools_renders_them_as_the_template_does(vlm):
    tools = [{
        "type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }
    }]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = vlm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   tools=tools)[0]
    tokenizer = vlm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True,
                                         chat_template=vlm.engine.input_processor.chat_template)
    assert '"get_weather"' in text and out.prompt_token_ids == tokenizer(
        text, add_special_tokens=False).input_ids
