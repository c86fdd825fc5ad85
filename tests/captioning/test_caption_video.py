"""Batch captioning over a folder that mixes images and videos (vlinfer.captioning, `python -m
vlinfer caption`): the clips are collected by extension, captioned in the same batches as the images
with their own prompt and sampling options, and their records carry the frames, grid and tokens the
model saw; a broken clip is one error record."""
import json

import pytest
from PIL import Image

from videos import drawn_clip, encode
from vlinfer import LLM
from vlinfer.captioning import (DEFAULT_VIDEO_PROMPT, CaptionInputError, caption_files,
                                collect_images)

VIDEO_KEYS = {
    "path", "caption", "tokens", "size", "num_image_tokens", "error", "num_frames", "grid_thw",
    "num_video_tokens", "duration"
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    for i, color in enumerate([(200, 40, 40), (30, 200, 30)]):
        Image.new("RGB", (64, 48), color).save(folder / f"img_{i}.png")
    encode(drawn_clip(16, 64, 96, seed=1), fps=8, path=folder / "clip_a.mp4")  # 2 s
    encode(drawn_clip(12, 48, 64, seed=2), fps=4, codec="libvpx-vp9", container="webm",
           path=folder / "clip_b.webm")
    (folder / "clip_broken.mp4").write_bytes(b"not a video " * 40)
    (folder / "notes.txt").write_text("skipped by extension")
    return folder


def test_collect_images_takes_videos_when_asked(folder, tmp_path):
    names = lambda paths: [p.rsplit("/", 1)[1] for p in paths]  # noqa: E731
    # images only, as before
    assert names(collect_images([str(folder)])) == ["img_0.png", "img_1.png"]
    assert names(collect_images([str(folder)], videos=True)) == [
        "clip_a.mp4", "clip_b.webm", "clip_broken.mp4", "img_0.png", "img_1.png"
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CaptionInputError, match="no image or video files"):
        collect_images([str(tmp_path / "empty")], videos=True)


def test_mixed_folder_is_captioned_with_video_records(folder, tmp_path):
    llm = LLM("qwen3-vl-tiny", max_model_len=1024, kv_cache_bytes=32 * 2 ** 20)
    out = tmp_path / "captions.jsonl"
    from vlinfer import SamplingParams
    asked, chat = [], llm.chat

    def recording_chat(conversations, *args, **kwargs):
        asked.extend(c[0]["content"] for c in conversations)
        return chat(conversations, *args, **kwargs)
    llm.chat = recording_chat
    summary = caption_files(llm, collect_images([str(folder)], videos=True), str(out), batch_size=8,
                            sampling_params=SamplingParams(temperature=0,
                                                           max_tokens=3), max_pixels=64 * 64,
                            video_options={"fps": 2, "video_min_pixels": 4096}, progress=False)
    assert (summary.captioned, summary.errors) == (4, 1)
    records = {
        r["path"].rsplit("/", 1)[1]: r
        for r in map(json.loads,
                     out.read_text().splitlines())
    }
    a, b, broken = records["clip_a.mp4"], records["clip_b.webm"], records["clip_broken.mp4"]
    for r in (a, b, broken):
        assert set(r) == VIDEO_KEYS
    # 2 s at 2 fps: 4 frames, 2 groups of 64x96 (a low video_min_pixels keeps them at their own
    # size: the tiny model has transformers' class default of 131072 pixels per clip, which would
    # upscale them)
    assert (a["num_frames"], a["grid_thw"], a["size"], a["num_video_tokens"]) == (4, [2, 4,
                                                                                      6], [64,
                                                                                           96], 12)
    assert a["duration"] == 2.0 and a["num_image_tokens"] is None and 1 <= a["tokens"] <= 3 and a[
        "error"] is None
    # 3 s of VP9 in WebM
    assert b["num_frames"] == 6 and b["grid_thw"][0] == 3 and b["error"] is None
    assert broken["caption"] is None and broken["num_frames"] is None and "not a video" in broken[
        "error"]
    assert not broken["error"].startswith("video 0")
    for name in ("img_0.png", "img_1.png"):  # the images' records are unchanged
        assert set(records[name]
                   ) == VIDEO_KEYS - {"num_frames", "grid_thw", "num_video_tokens", "duration"}
        assert records[name]["num_image_tokens"] >= 1
    # one batch; each clip asked with the video prompt and its options on its part, each image with
    # the image one
    assert [[p["type"] for p in parts]
            for parts in asked] == [["video", "text"]] * 3 + [["image", "text"]] * 2
    assert asked[0] == [{
        "type": "video", "video": str(folder / "clip_a.mp4"), "fps": 2, "video_min_pixels": 4096
    }, {"type": "text", "text": DEFAULT_VIDEO_PROMPT}]
    assert asked[-1][1] == {"type": "text", "text": "Describe this image."}
    del llm.chat
    with pytest.raises(ValueError, match="unknown video options"):
        caption_files(llm, [str(folder / "clip_a.mp4")], str(tmp_path / "x.jsonl"),
                      video_options={"fsp": 2})


def test_cli_video_flags(folder):
    from vlinfer.cli import build_parser
    from vlinfer.cli.caption import _video_options
    args = build_parser().parse_args([
        "caption",
        str(folder), "--out", "c.jsonl", "--fps", "1", "--max-frames", "8", "--video-prompt",
        "What happens?"
    ])
    assert _video_options(args) == {"fps": 1.0, "max_frames": 8
                                    } and args.video_prompt == "What happens?"
