"""Video input for Qwen3-VL against transformers 5.24: sampling and sizing, PyAV decoding, and the
engine's float32 logits and greedy tokens for clips, odd frame counts, clips with images, chunked
prefill, prefix caching, preemption and hostile files."""
import base64
import functools
import json

import numpy as np
import pytest
import torch

from engine_checks import assert_block_pool_empty
from images import picture
from videos import blank_video, drawn_clip, encode
from vlinfer import LLM, RequestError, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.multimodal.video_io import VideoLimits, VideoLoadError, load_video
from vlinfer.multimodal.video_processor import (Qwen3VLVideoProcessor, VideoOptions,
                                                video_smart_resize)
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
from video_cases import ASK, CLIP_ODD, HUB_VIDEO_CONFIG, META_EVEN, META_ODD, V, hf_inputs, request

NUM_NEW = 32
VIDEO_PAD = 151656
I = "<|vision_start|><|image_pad|><|vision_end|>"
CLIP_EVEN = drawn_clip(16, 64, 96, seed=1)   # 16 frames at 8 fps: fps=2 samples 4 -> 2 groups
IMG = picture(64, 64, 1)

SHAPES = {
    "heads4-ds01": dict(num_heads=4, num_kv_heads=2, head_dim=32, mrope_section=(6, 5, 5),
                        vision_depth=2, deepstack_visual_indexes=[0, 1], tie_word_embeddings=False),
    "heads8-ds12": dict(text_layers=3, num_heads=8, num_kv_heads=2, head_dim=16,
                        mrope_section=(4, 2, 2), vision_depth=3, vision_heads=2,
                        deepstack_visual_indexes=[1, 2], tie_word_embeddings=False),
}

# (prompt, images, videos as (frames, metadata)); the text and image-only requests make the batch a
# mix. The first is long enough before its clip (16+ tokens: a whole KV block) for the prefix-cache
# test to reuse it.
LOOK = "Look at every frame of this clip before you answer the question below. "
CASES = [
    (ASK.format(LOOK + V), [], [(CLIP_EVEN, META_EVEN)]),
    (ASK.format(V), [], [(CLIP_ODD, META_ODD)]),
    (ASK.format("Compare " + V + " with " + V), [], [(CLIP_EVEN, META_EVEN), (CLIP_ODD, META_ODD)]),
    (ASK.format(I + " then " + V), [IMG], [(CLIP_ODD, META_ODD)]),
    (ASK.format("Name a colour."), [], []),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """shape name -> (folder, transformers model), each built on first use. Both shapes take the
    logits check; the generation checks (32 greedy tokens of transformers per prompt, the slow part)
    run on heads4-ds01."""
    from transformers import Qwen3VLForConditionalGeneration

    @functools.cache
    def get(shape):
        path = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp(shape)), seed=0, **SHAPES[shape])
        with open(f"{path}/video_preprocessor_config.json", "w") as f:
            json.dump(HUB_VIDEO_CONFIG, f)
        return path, Qwen3VLForConditionalGeneration.from_pretrained(path,
                                                                     dtype=torch.float32).eval()
    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("heads4-ds01")


@pytest.fixture(scope="module")
def llm(checkpoint):
    """One engine on heads4-ds01 for the tests that leave no state that matters (pool empty after
    each)."""
    return make_llm(checkpoint[0])


def make_llm(path, **kw):
    kw.setdefault("kv_cache_bytes", 32 * 2 ** 20)
    kw.setdefault("max_model_len", 2048)
    return LLM(path, dtype="float32", **kw)


def hf_greedy(model, ids, kwargs, num_new=NUM_NEW):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                             **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(checkpoint):
    path, model = checkpoint
    return [hf_greedy(model, *hf_inputs(path, *case)) for case in CASES]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_logits_match_transformers(checkpoints, llm, shape):
    path, model = checkpoints(shape)
    llm = llm if shape == "heads4-ds01" else make_llm(path)
    engine = llm.engine
    for text, images, videos in CASES[:4]:
        seq = engine.make_sequence(request(text, images, videos))
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        ids, kwargs = hf_inputs(path, text, images, videos)
        # the same expansion and timestamps, the template's pair replaced
        assert ids[0].tolist() == seq.token_ids
        with torch.no_grad():
            ref = model(input_ids=ids, **kwargs).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
        engine.abort_request(seq.request_id)
    assert_block_pool_empty(llm)


def test_mixed_batch_matches_transformers_and_echoes_sampling(llm, references):
    outs = llm.generate([request(*case) for case in CASES], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert [len(o.videos) for o in outs] == [1, 1, 2, 1, 0]
    even, odd = outs[0].videos[0], outs[1].videos[0]
    assert even["frames_indices"] == [0, 5, 10, 15
                                      ] and even["grid_thw"] == [2, 4, 6] and even["fps"] == 8.0
    # linspace(0, 9, 5).round() = [0, 2, 4, 7, 9], padded with 9: groups (0, 2), (4, 7), (9, 9) at 4
    # fps
    assert odd["num_frames"] == 5 and odd["grid_thw"] == [3, 8, 10] and odd["timestamps"] == [
        0.25, 1.375, 2.25
    ]
    # "<x.y seconds>": 6
    assert even["num_tokens"] == outs[0].prompt_token_ids.count(VIDEO_PAD) + 2 * (2 + 6)
    assert_block_pool_empty(llm)


def test_chunked_prefill_and_preemption_through_videos(checkpoint, llm, references):
    """One engine both chunks (16 tokens a step: a clip's group of 20 tokens spans two steps, and no
    clip fits one step) and preempts (a KV pool of one longest request plus a block)."""
    per_block = llm.engine.model_runner.cache_pool.bytes_per_block
    longest = max(llm.engine.make_sequence(request(*case)).num_tokens for case in CASES) + NUM_NEW
    blocks = (longest + 15) // 16 + 1
    small = make_llm(checkpoint[0], kv_cache_bytes=blocks * per_block, max_model_len=blocks * 16,
                     max_num_batched_tokens=16)
    outs = small.generate([request(*case) for case in CASES], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert small.engine.scheduler.num_preemptions > 0
    assert_block_pool_empty(small)


def test_prefix_cache_hits_same_clip_only(checkpoint, references):
    path, model = checkpoint
    llm = make_llm(path)
    case = CASES[0]
    first = llm.generate([request(*case)], GREEDY, use_tqdm=False)[0]
    again = llm.generate([request(*case)], GREEDY, use_tqdm=False)[0]
    # the outer <|vision_start|>, then the first timestamp
    video_start = first.prompt_token_ids.index(151652) + 1
    assert video_start >= 16
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > video_start
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == references[0]
    assert llm.engine.model_runner.vision.num_images_encoded == 2  # its 2 groups, encoded once
    # The same clip sampled at 4 fps: other frames and timestamps, so nothing after the clip's start
    # is reused.
    # a cache miss: an ordinary run, 8 do
    few = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    other = llm.generate([request(*case, fps=4)], few, use_tqdm=False)[0]
    assert other.num_cached_tokens == video_start // 16 * 16
    assert other.videos[0]["num_frames"] == 8
    encoded = llm.engine.model_runner.vision.num_images_encoded
    assert encoded == 2 + 4  # its 4 groups, none from the cache
    assert other.outputs[0].token_ids == hf_greedy(model, *hf_inputs(path, *case, fps=4), num_new=8)
    assert_block_pool_empty(llm)


# ---------------------------------------------------------------------------- sampling and sizing
# vs transformers


@pytest.mark.parametrize("total, source_fps", [(10, 4.0), (37, 10.0), (300, 30.0), (7, 24.0),
                                               (2000, 25.0)])
def test_sampling_matches_transformers(total, source_fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as HF
    from transformers.video_utils import VideoMetadata
    hf, ours = HF(), Qwen3VLVideoProcessor()
    for kw in [dict(fps=2), dict(fps=0.5), dict(fps=7.5), dict(num_frames=5), dict(num_frames=16),
               dict(fps=2, max_frames=6), dict(fps=1, min_frames=8)]:
        opts = VideoOptions.of(kw)
        ref_kw = {"fps": None, **kw} if "num_frames" in kw else kw
        ref = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps),
                               **{k: v for k, v in ref_kw.items() if k in ("fps", "num_frames")})
        if "max_frames" in kw or "min_frames" in kw:  # transformers reads these from the instance
            ref = HF(**{k: v for k, v in kw.items() if k.endswith("_frames")}).sample_frames(
                VideoMetadata(total_num_frames=total, fps=source_fps), fps=kw["fps"])
        indices = ours.sample_indices(total, source_fps, opts)
        assert indices == ref.tolist(), kw
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        assert ours.timestamps(indices, source_fps) == Qwen3VLProcessor._calculate_timestamps(
            None, ref, source_fps, 2)


@pytest.mark.parametrize("size", [(4096, 25165824), (128 * 32 * 32, 768 * 32 * 32),
                                  (65536, 1 << 20)])
def test_sizing_matches_transformers(size):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as HF
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    hf = HF(size={"shortest_edge": size[0], "longest_edge": size[1]})
    ours = Qwen3VLVideoProcessor(min_pixels=size[0], max_pixels=size[1])
    for frames in (2, 5, 16, 120, 600):
        for h, w in ((20, 30), (240, 320), (448, 448), (720, 1280), (1080, 1920), (2160, 3840),
                     (100, 3000)):
            for cap in (False, True):
                opts = VideoOptions(cap_pixels_per_frame=cap)
                got = ours.resized_size(frames, h, w, opts)
                if not cap:
                    assert got == smart_resize(frames, h, w, temporal_factor=2, factor=32,
                                               min_pixels=size[0], max_pixels=size[1])
                patches = hf.get_num_of_video_patches(frames, h, w, {"cap_pixels_per_frame": cap})
                assert ((frames + 1) // 2) * (got[0] // 16) * (got[1] // 16) == patches, (frames, h,
                                                                                          w, cap)


def test_pixels_and_padding_match_transformers():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as HF
    from transformers.video_utils import VideoMetadata
    clip = drawn_clip(23, 90, 130, seed=5)
    for kw in [dict(fps=2), dict(num_frames=7), dict(fps=3, video_max_pixels=200000)]:
        ref_kw = {
            ("size" if k == "video_max_pixels" else k): (
                {"shortest_edge": 131072, "longest_edge": v} if k == "video_max_pixels" else v)
            for k, v in kw.items()
        }
        if "num_frames" in kw:
            ref_kw["fps"] = None
        ref = HF()(videos=[clip], video_metadata=[VideoMetadata(total_num_frames=23,
                                                                fps=6.0)], do_sample_frames=True,
                   return_metadata=True, return_tensors="pt", cap_pixels_per_frame=False, **ref_kw)
        ours = Qwen3VLVideoProcessor()
        opts = VideoOptions.of(kw)
        loaded = load_video(clip, ours.plan(opts), ours.resize, metadata={"fps": 6.0})
        video = ours(loaded, opts)
        assert list(video.grid_thw) == ref["video_grid_thw"][0].tolist()
        assert video.frames_indices == list(ref["video_metadata"][0].frames_indices)
        assert torch.equal(video.pixel_values, ref["pixel_values_videos"])


# ---------------------------------------------------------------------------- PyAV files


@pytest.mark.parametrize("codec, container", [("libx264", "mp4"), ("mpeg4", "avi"),
                                              ("libvpx-vp9", "webm"), ("mjpeg", "matroska"),
                                              ("libx264", "mov")])
def test_video_files_decode_to_the_expected_frames(codec, container, tmp_path):
    from transformers.video_utils import load_video as hf_load_video
    clip = drawn_clip(40, 64, 96, seed=3)
    path = tmp_path / f"clip.{container}"
    encode(clip, fps=10, codec=codec, container=container, gop=6, path=path)
    ours = Qwen3VLVideoProcessor()
    loaded = load_video(str(path), ours.plan(VideoOptions()), ours.resize)
    assert loaded.source.total_num_frames == 40 and loaded.fps == 10.0
    # 4 s at 2 fps
    assert loaded.frames_indices == np.linspace(0, 39, 8).round().astype(int).tolist()
    # Each decoded frame is the drawn one (lossy codecs: close, and nearer to it than to any other
    # frame) ...
    size = tuple(loaded.frames.shape[-2:])
    drawn = ours.resize(torch.from_numpy(clip).permute(0, 3, 1, 2), size).float()
    for k, index in enumerate(loaded.frames_indices):
        errors = (drawn - loaded.frames[k].float()).abs().mean(dim=(1, 2, 3))
        assert int(errors.argmin()) == index and errors[index] < 25, (index, errors[index])
    # ... and, seeking included, bit for bit what transformers' own PyAV loader decodes for those
    # frames.
    # transformers reads the header's frame count (0 there)
    if container != "webm" and container != "matroska":
        frames, _ = hf_load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_:
                                  np.array(loaded.frames_indices))
        ref = ours.resize(torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2), size)
        assert torch.equal(ref, loaded.frames)


# ---------------------------------------------------------------------------- hostile input

def hostile_cases():
    good = encode(drawn_clip(12, 32, 48, seed=4), fps=4)
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 3: len(corrupt) // 3 + 600] = bytes(600)
    return {
        "truncated": (good[:len(good) // 2], "video 0"),
        "not a video": (b"this is a text file, not a video" * 20, "not a video"),
        "an image file": (base64.b64decode(
            "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJ"
            "RU5ErkJggg=="
        ), "video 0"),
        "zero-size frames": ((np.zeros((4, 0, 0, 3), np.uint8), {"fps": 2.0}), "empty size"),
        "no frames": ((np.zeros((0, 32, 32, 3), np.uint8), {"fps": 2.0}), "no frames"),
        "one frame": ((np.zeros((1, 32, 32, 3), np.uint8), {"fps": 2.0}), "at least 2 frames"),
        "archive bomb (8192x4352 frames in 100 KB)": (blank_video(8192, 4352, 2, 1),
                                                      "possible decompression bomb"),
        "very long clip": (blank_video(16, 16, 900, 1), "over the limit of 600 s"),
        "too many frames": (blank_video(16, 16, 1200, 100), "more than 1000 frames"),
        "wrong array": (np.zeros((4, 32, 32), np.uint8), "uint8 [T, H, W, 3]"),
    }


@pytest.fixture
def limits(llm):
    """Sets the shared engine's video limits for one test, then puts its own back."""
    videos = llm.engine.input_processor.mm_processor.videos
    own = videos.limits
    yield lambda new: setattr(videos, "limits", new)
    videos.limits = own


def test_hostile_videos_are_per_request_errors(llm, limits, references):
    limits(VideoLimits(max_seconds=600, max_source_frames=1000))
    cases = hostile_cases()
    reqs = [request(*CASES[0]), request(*CASES[4])
            ] + [request(ASK.format(V), [], [video]) for video, _ in cases.values()]
    with pytest.raises(RequestError) as info:
        llm.generate(reqs, GREEDY, use_tqdm=False)
    outs = info.value.outputs
    # the others completed
    assert [o.outputs[0].token_ids for o in outs[:2]] == [references[0], references[4]]
    for out, (name, (_, match)) in zip(outs[2:], cases.items()):
        assert out.error and match in out.error and out.outputs[0].finish_reason == "error", (
            name, out.error)
    # a clip longer than max_model_len is refused at admission, naming its tokens
    # 160 groups of 6 + 8 tokens: 2240 > 2048
    with pytest.raises(RequestError, match="its videos take"):
        llm.generate([request(*CASES[0], num_frames=320)], GREEDY, use_tqdm=False)
    assert_block_pool_empty(llm)


def test_frame_cap_clamps_sampling_and_refuses_more(llm, limits):
    limits(VideoLimits(max_frames=6))
    one = SamplingParams(temperature=0, max_tokens=1)
    # fps=8 samples all 16 frames of CLIP_EVEN; the cap clamps that to 6, as max_frames=6 would
    out = llm.generate([request(*CASES[0], fps=8)], one, use_tqdm=False)[0]
    ref = Qwen3VLVideoProcessor().sample_indices(16, 8.0, VideoOptions(fps=8, max_frames=6))
    assert out.videos[0]["frames_indices"] == ref and len(ref) == 6
    for kw, match in [({"num_frames": 8}, "num_frames=8 is over the limit of 6 frames"),
                      ({"max_frames": 7}, "max_frames=7 is over the limit of 6 frames")]:
        with pytest.raises(RequestError, match=match):
            llm.generate([request(*CASES[0], **kw)], one, use_tqdm=False)
    # kept as given: 16 frames
    presampled = (CLIP_EVEN, {"fps": 8.0, "frames_indices": list(range(16))})
    with pytest.raises(RequestError, match="16 frames to encode, over the limit of 6"):
        llm.generate([request(ASK.format(V), [], [presampled])], one, use_tqdm=False)
    assert_block_pool_empty(llm)


def test_missing_pyav_is_named(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_av(name, *args, **kwargs):
        if name == "av":
            raise ImportError("no av")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_av)
    ours = Qwen3VLVideoProcessor()
    with pytest.raises(VideoLoadError, match=r"pip install av .*vlinfer\[video\]"):
        load_video(b"\x00" * 64, ours.plan(VideoOptions()), ours.resize)
    assert video_smart_resize(4, 64, 64, 2, 32, 4096, 1 << 24) == (64, 64)


# ---------------------------------------------------------------------------- chat and Pipeline

def test_chat_video_parts_and_pipeline(checkpoint, llm, tmp_path):
    data = encode(CLIP_EVEN, fps=8, path=tmp_path / "clip.mp4")
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{
        "role": "user", "content": [{"type": "video", "video": str(tmp_path / "clip.mp4")},
                                    {"type": "video_url", "video_url": {"url": uri},
                                     "fps": 4}, {"type": "text", "text": "What differs?"}]
    }]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt.count(V) == 2
    # the part's own fps took effect for the second
    assert [v["num_frames"] for v in out.videos] == [4, 8]
    from vlinfer import Pipeline
    pipe = Pipeline(checkpoint[0], dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=2048)
    text = pipe(video=str(tmp_path / "clip.mp4"), prompt="What happens?", temperature=0,
                max_tokens=4)
    assert isinstance(text, str)
    assert_block_pool_empty(llm)
