"""video_url parts through the OpenAI-compatible server and the official `openai` client: a data URI
streamed back, and hostile clips answered with 4xx while the server keeps serving."""
import base64
import re

import openai
import pytest

from videos import blank_video, drawn_clip, encode
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.multimodal.video_io import VideoLimits
from vlinfer.serve import ServeConfig, build_app
from vlinfer.cli.serve import build_parser, config_from_args
from serve_helpers import ServerThread

MODEL = "qwen3-vl-tiny"
CLIP = encode(drawn_clip(12, 64, 96, seed=7), fps=4)
# 12 s: 24 frames at 2 fps, over the cap of 16
LONGER = encode(drawn_clip(48, 32, 48, seed=8), fps=4)
# the server's --max-video-frames / --max-video-seconds
CAPS = VideoLimits(max_frames=16, max_seconds=60)


def uri(data: bytes, media: str = "video/mp4") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def video_messages(url: str) -> list:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens in the clip?"}]}]


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    app = build_app(loop, ServeConfig(served_model_names=(MODEL,), video=CAPS))
    try:
        with ServerThread(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60,
                                                     max_retries=0) as c:
            yield c, engine
    finally:
        loop.close()


def test_video_data_uri_streams_an_answer(client):
    c, engine = client
    stream = c.chat.completions.create(model=MODEL, messages=video_messages(uri(CLIP)),
                                       max_tokens=6, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = c.chat.completions.create(model=MODEL, messages=video_messages(uri(CLIP)), max_tokens=6,
                                      temperature=0)
    assert text == whole.choices[0].message.content and whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens > 40  # the clip's groups and timestamps, not one placeholder


@pytest.mark.parametrize("url, match", [
    (uri(CLIP[:len(CLIP) // 2]), "video 0"),
    (uri(b"not a video at all" * 10), "not a video"),
    (uri(blank_video(8192, 4352, 2, 1)), "decompression bomb"),
    (uri(CLIP, "image/png"), "not a video"),
    ("https://example.com/clip.mp4", "video URLs are disabled on this server"),
    ("file:///etc/passwd", "file"),
])
def test_hostile_video_is_4xx_and_serving_continues(client, url, match):
    c, engine = client
    with pytest.raises(openai.BadRequestError, match=match):
        c.chat.completions.create(model=MODEL, messages=video_messages(url), max_tokens=2)
    ok = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_video_urls_are_fetched_under_the_video_byte_limit():
    """An http(s) video from an allowed host is fetched like an image but under --max-video-bytes,
    not the image limit: a clip twice the image limit is answered as its data URI is; one over the
    video limit is a 400."""
    from images import ImageServer
    from vlinfer.serve.security import ImagePolicy
    host = ImageServer(CLIP)
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    try:
        for max_video_bytes in (len(CLIP) + 1, len(CLIP) - 1):
            images = ImagePolicy(allowed_url_hosts=("127.0.0.1",), allow_private_urls=True,
                                 max_image_bytes=len(CLIP) // 2, max_video_bytes=max_video_bytes)
            app = build_app(loop,
                            ServeConfig(served_model_names=(MODEL, ), video=CAPS, images=images))
            with ServerThread(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="x",
                                                         timeout=60, max_retries=0) as c:
                ask = dict(model=MODEL, max_tokens=4, temperature=0)
                if max_video_bytes > len(CLIP):
                    fetched = c.chat.completions.create(
                        messages=video_messages(f"{host.url}/clip.mp4"), **ask)
                    inline = c.chat.completions.create(messages=video_messages(uri(CLIP)), **ask)
                    assert fetched.choices[0].message.content == inline.choices[0].message.content
                    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
                else:
                    with pytest.raises(openai.BadRequestError, match=str(max_video_bytes)):
                        c.chat.completions.create(messages=video_messages(f"{host.url}/clip.mp4"),
                                                  **ask)
    finally:
        loop.close()
        host.close()


def prompt_tokens(c, url: str, **mm_kwargs) -> int:
    # video_min_pixels: the tiny model's processor has transformers' class default (131072 pixels
    # per clip), which would upscale fewer frames more; this keeps every frame at its own size, so
    # each group costs the same.
    extra = {"mm_processor_kwargs": {"video_min_pixels": 4096, **mm_kwargs}}
    return c.chat.completions.create(model=MODEL, messages=video_messages(url), max_tokens=1,
                                     extra_body=extra).usage.prompt_tokens


def test_video_options_in_mm_processor_kwargs_take_effect(client):
    c, engine = client
    # 4 and 8 frames: 2 and 4 temporal groups, each its timestamp text, vision_start / end and pads
    four, eight = prompt_tokens(c, uri(CLIP),
                                num_frames=4), prompt_tokens(c, uri(CLIP), num_frames=8)
    default = prompt_tokens(c, uri(CLIP))  # 3 s at the default 2 fps: 6 frames
    per_group = (eight - four) // 2
    assert eight - four == 2 * per_group > 0 and default == four + per_group
    # 3 s at 1 fps: 3 frames, raised to min_frames=4
    assert prompt_tokens(c, uri(CLIP), fps=1.0) == four
    # the frame cap clamps default sampling (24 frames at 2 fps -> 16) as max_frames does
    assert prompt_tokens(c, uri(LONGER)) == prompt_tokens(c, uri(LONGER), num_frames=16)


@pytest.mark.parametrize("kwargs, match", [
    ({"fps": 2, "num_frames": 4}, "mutually exclusive"),
    ({"fps": -1}, "fps must be a positive number"),
    ({"num_frames": 2.5}, "num_frames must be a positive integer"),
    ({"num_frames": 32}, "num_frames=32 is over this server's limit of 16 frames"),
    ({"max_frames": 17}, "max_frames=17 is over this server's limit of 16"),
    ({"video_min_pixels": 10**12}, "over the model's video budget"),
    ({"do_sample_frames": 1}, "do_sample_frames must be true or false"),
    ({"fsp": 2},
     re.escape("unknown mm_processor_kwargs ['fsp']; accepted: min_pixels, max_pixels, detail, fps")
     ),
    ({"max_pixels": 1.5}, "max_pixels must be an integer"),
])
def test_bad_video_options_are_400(client, kwargs, match):
    c, _ = client
    with pytest.raises(openai.BadRequestError, match=match):
        c.chat.completions.create(model=MODEL, messages=video_messages(uri(CLIP)), max_tokens=1,
                                  extra_body={"mm_processor_kwargs": kwargs})


def test_duration_cap_is_400(client):
    c, _ = client
    with pytest.raises(openai.BadRequestError, match="90 s long, over the limit of 60 s"):
        c.chat.completions.create(model=MODEL,
                                  messages=video_messages(uri(blank_video(16, 16, 90,
                                                                          1))), max_tokens=1)


def test_cli_video_caps():
    args = build_parser().parse_args(["--max-video-frames", "32", "--max-video-seconds", "120"])
    assert config_from_args(args).video == VideoLimits(max_frames=32, max_seconds=120.0)
    assert config_from_args(build_parser().parse_args([])).video == VideoLimits(
        max_frames=768, max_seconds=3600.0)
    with pytest.raises(ValueError, match="--max-video-frames must be > 0"):
        config_from_args(build_parser().parse_args(["--max-video-frames", "0"]))
