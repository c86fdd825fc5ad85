"""One over-limit request (one image more than the table's per-request limit,
vlinfer/inputs/limits.py) refused the same way, naming the same limit, by LLM.generate, the server
and the CLI."""
import openai
import pytest

from images import picture
from vlinfer import LLM
from vlinfer.cli import main
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.inputs.limits import MAX_IMAGES, too_many_images
from vlinfer.serve import ServeConfig, build_app
from serve_helpers import ServerThread, data_uri, png_bytes

MODEL = "qwen3-vl-tiny"
COUNT = MAX_IMAGES + 1
REFUSAL = too_many_images(COUNT)
ENGINE = dict(dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)


def test_the_refusal_names_the_limit():
    assert f"{COUNT} images" in REFUSAL \
        and f"the limit is {MAX_IMAGES} per request (max_images)" in REFUSAL


def test_llm_generate_refuses():
    llm = LLM(MODEL, **ENGINE)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>" * COUNT + "Describe.",
              "multi_modal_data": {"image": [picture(16, 16, seed) for seed in range(COUNT)]}}
    with pytest.raises(ValueError) as e:
        llm.generate([prompt])
    assert REFUSAL in str(e.value)


def test_server_refuses():
    engine = LLMEngine(MODEL, **ENGINE)
    loop = EngineLoop(engine)
    try:
        with ServerThread(build_app(loop, ServeConfig(served_model_names=(MODEL,)))) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60,
                               max_retries=0) as client:
                parts = [{
                    "type": "image_url",
                    "image_url": {"url": data_uri(png_bytes(seed=s, size=(16, 16)))}
                } for s in range(COUNT)]
                with pytest.raises(openai.BadRequestError) as e:
                    client.chat.completions.create(
                        model=MODEL, max_tokens=2, messages=[{
                            "role": "user",
                            "content": parts + [{"type": "text", "text": "Describe."}]
                        }])
    finally:
        loop.close()
    assert REFUSAL in str(e.value) and e.value.code == "too_many_images"


def test_cli_refuses(tmp_path, capsys):
    paths = []
    for seed in range(COUNT):
        path = tmp_path / f"{seed}.png"
        picture(16, 16, seed).save(path)
        paths += ["--image", str(path)]
    code = main([
        "generate", "Describe.", "--model", MODEL, "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-size", "64M", *paths
    ])
    assert code  # an error line and a non-zero exit status
    assert REFUSAL in capsys.readouterr().err


def test_videos_count_toward_the_limit():
    """MAX_IMAGES images and one video: one medium over the limit, refused with the same words by
    LLM.generate and the server (videos are media of the request as images are)."""
    import numpy as np
    frames = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    llm = LLM(MODEL, **ENGINE)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>" * MAX_IMAGES +
              "<|vision_start|><|video_pad|><|vision_end|>Describe.",
              "multi_modal_data": {"image": [picture(16, 16, seed) for seed in range(MAX_IMAGES)],
                                   "video": frames}}
    with pytest.raises(ValueError) as e:
        llm.generate([prompt])
    assert REFUSAL in str(e.value)
    loop = EngineLoop(llm.engine)
    try:
        with ServerThread(build_app(loop, ServeConfig(served_model_names=(MODEL,)))) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60,
                               max_retries=0) as client:
                parts = [{
                    "type": "image_url",
                    "image_url": {"url": data_uri(png_bytes(seed=s, size=(16, 16)))}
                } for s in range(MAX_IMAGES)]
                parts.append(
                    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
                with pytest.raises(openai.BadRequestError) as e:
                    client.chat.completions.create(
                        model=MODEL, max_tokens=2, messages=[{
                            "role": "user",
                            "content": parts + [{"type": "text", "text": "Describe."}]
                        }])
    finally:
        loop.close()
    assert REFUSAL in str(e.value) and e.value.code == "too_many_images"
