"""LoRA on the user-facing surfaces but the server (tests/serve/test_serve_lora.py):
Pipeline(lora=PATH), `vlinfer generate|chat|caption --lora PATH` and the engine flags --enable-lora,
--max-loras, --max-lora-rank, --max-cpu-loras. PEFT adapters on the language model of a tiny random
Qwen3-VL (float32), each surface's greedy answer equal to LLM.generate / LLM.chat with the same
LoRARequest.
"""
import io
import json
import os

import pytest

from vlinfer import LLM, LoRARequest, Pipeline, SamplingParams
from vlinfer.captioning import image_limits
from vlinfer.cli import build_parser, main
from vlinfer.cli.options import engine_options
from lora_surfaces_cases import EVERY_LINEAR, checkpoint, make_vl_adapter

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_bytes=32 << 20)
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-size", "32M"]
from dependencies import REPO
IMAGE = os.path.join(REPO, "examples", "images", "cat_face.png")
MAX_PIXELS = 64 * 64
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    return make_vl_adapter(checkpoint, str(tmp_path_factory.mktemp("adapters") / "shapes-style"), 8,
                           EVERY_LINEAR, 1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, enable_lora=True, **ENGINE)


@pytest.fixture(scope="module")
def pipe(checkpoint, adapter):
    return Pipeline(checkpoint, lora=adapter, **ENGINE)


def chat_text(llm, messages, lora, **kw) -> str:
    return llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora, **kw)[0].outputs[0].text


def test_pipeline_runs_its_adapter_on_every_request(pipe, llm, adapter):
    lora = LoRARequest("shapes-style", 1, adapter)
    assert pipe.lora_request == lora  # named after its folder
    assert pipe.engine.config.enable_lora
    messages = [{"role": "user", "content": "Hello there."}]
    answer = pipe(prompt="Hello there.", max_tokens=6, temperature=0)
    assert answer == chat_text(llm, messages, lora)
    assert answer != chat_text(llm, messages, None)  # the adapter changes the answer
    assert "".join(pipe.stream(messages=messages, max_tokens=6, temperature=0)) == answer
    image = [{
        "role": "user", "content": [{"type": "image", "image": IMAGE},
                                    {"type": "text", "text": "Describe."}]
    }]
    kwargs = {"max_pixels": MAX_PIXELS, "min_pixels": MAX_PIXELS}
    assert pipe.caption([IMAGE], "Describe.", max_tokens=6, temperature=0,
                        mm_processor_kwargs=kwargs) == \
        [chat_text(llm, image, lora, mm_processor_kwargs=kwargs)]


def test_pipeline_refuses_a_bad_adapter_when_built(checkpoint, adapter, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        Pipeline(checkpoint, lora=str(tmp_path / "nowhere"), **ENGINE)
    with pytest.raises(ValueError, match=r"'shapes-style': rank 8 is above max_lora_rank=4"):
        Pipeline(checkpoint, lora=adapter, max_lora_rank=4, **ENGINE)
    with pytest.raises(ValueError, match="enable_lora=False"):
        Pipeline(checkpoint, lora=adapter, enable_lora=False, **ENGINE)


def test_caption_cli_with_lora_equals_the_pipeline(checkpoint, adapter, pipe, llm, tmp_path,
                                                   capsys):
    out = tmp_path / "captions.jsonl"
    assert main([
        "caption", IMAGE, "--out",
        str(out), "--model", checkpoint, "--lora", adapter, "--max-pixels",
        str(MAX_PIXELS), "--max-tokens", "6", "--no-progress", *ENGINE_FLAGS
    ]) == 0
    record, = [json.loads(line) for line in out.read_text().splitlines()]
    expected = pipe.caption([IMAGE], max_tokens=6, temperature=0,
                            mm_processor_kwargs=image_limits(pipe, MAX_PIXELS))
    # a record's caption is stripped
    assert record["error"] is None and record["caption"] == expected[0].strip()
    base = llm.chat([{
        "role": "user", "content": [{"type": "image", "image": IMAGE},
                                    {"type": "text", "text": "Describe this image."}]
    }], GREEDY, use_tqdm=False, mm_processor_kwargs=image_limits(llm,
                                                                 MAX_PIXELS))[0].outputs[0].text
    assert record["caption"] != base.strip()
    capsys.readouterr()
    # Refused before a model loads: --lora with --ray; after it loads, a bad adapter, named.
    assert main(["caption", IMAGE, "--out",
                 str(tmp_path / "x.jsonl"), "--lora", adapter, "--ray"]) == 2
    assert "--lora is not supported with --ray" in capsys.readouterr().err
    assert main([
        "caption", IMAGE, "--out",
        str(tmp_path / "y.jsonl"), "--model", checkpoint, "--lora", adapter, "--max-lora-rank", "4",
        "--no-progress", *ENGINE_FLAGS
    ]) == 2
    assert "error: LoRA adapter 'shapes-style': rank 8 is above --max-lora-rank=4" \
        in capsys.readouterr().err
    assert not (tmp_path / "y.jsonl").exists()


def test_generate_and_chat_cli_with_lora_equal_the_pipeline(checkpoint, adapter, pipe, capsys,
                                                            monkeypatch):
    answer = pipe(prompt="Hello there.", max_tokens=6, temperature=0)
    assert main([
        "generate", "Hello there.", "--model", checkpoint, "--lora", adapter, "--max-tokens", "6",
        *ENGINE_FLAGS
    ]) == 0
    assert capsys.readouterr().out == answer + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there.\n/exit\n"))
    assert main([
        "chat", "--model", checkpoint, "--lora", adapter, "--max-tokens", "6", "--temperature", "0",
        *ENGINE_FLAGS
    ]) == 0
    out, err = capsys.readouterr()
    assert out == f"> {answer}\n> " and "LoRA adapter 'shapes-style'" in err


def test_lora_flags_reach_the_engine_options():
    parser = build_parser()
    options = engine_options(parser.parse_args(["generate", "hi"]))
    assert (options["enable_lora"], options["max_loras"], options["max_lora_rank"],
            options["max_cpu_loras"]) == \
        (False, 1, 16, None)  # EngineConfig's (vLLM's) defaults
    options = engine_options(
        parser.parse_args([
            "caption", "x.png", "--out", "o.jsonl", "--lora", "/a/b", "--max-loras", "2",
            "--max-lora-rank", "64", "--max-cpu-loras", "3"
        ]))
    assert (options["enable_lora"], options["max_loras"], options["max_lora_rank"],
            options["max_cpu_loras"]) == \
        (True, 2, 64, 3)  # --lora turns LoRA on by itself
    assert engine_options(parser.parse_args(["chat", "--enable-lora"]))["enable_lora"] is True
    assert LoRARequest.from_path("/adapters/sql-lora/") == LoRARequest(
        "sql-lora", 1, "/adapters/sql-lora/")
