"""Image input layer + Qwen3-VL image preprocessor, checked against transformers' fast
Qwen2VLImageProcessor (what AutoImageProcessor builds for qwen3_vl), constructed locally with the
published Qwen3-VL parameters."""
import base64
import io
import json
import struct
import warnings
import zlib

import numpy as np
import PIL.Image
import PIL.ImageOps
import pytest
import torch
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from images import ImageServer
from vlinfer.multimodal.image_io import ImageLoadError, image_content_hash, load_image
from vlinfer.multimodal.image_processor import ProcessedImages, Qwen3VLImageProcessor, smart_resize
from vlinfer.multimodal.url_fetch import UrlPolicy

QWEN3_VL_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
TOL = 1e-5


@pytest.fixture(scope="module")
def ref():
    return Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3,
                                 size={"shortest_edge": 65536, "longest_edge": 16777216})


@pytest.fixture(scope="module")
def proc():
    return Qwen3VLImageProcessor()


def rand_image(h, w, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    # Smooth-ish content plus noise so bicubic resampling has real work (and overshoot) to do.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), ((xx + yy) % 256)],
                    -1)
    arr = np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(arr).convert(mode) if mode != "RGB" else PIL.Image.fromarray(arr)


def ref_call(ref, images, min_pixels=None, max_pixels=None, **kw):
    size = {"shortest_edge": min_pixels or 65536, "longest_edge": max_pixels or 16777216}
    return ref(images=images, size=size, return_tensors="pt", **kw)


def assert_same(ours: ProcessedImages, theirs):
    assert ours.grid_thw.tolist() == theirs["image_grid_thw"].tolist()
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    diff = (ours.pixel_values.cpu() - theirs["pixel_values"].cpu()).abs().max().item()
    assert diff <= TOL, diff


# -------------------------------------------------------------------------------------------
# processor parity

SIZES = [(32, 32), (57, 300), (300, 57), (480, 640), (640, 480), (997, 1000), (720, 1280),
         (1280, 720), (20, 300), (5, 5), (33, 47), (1023, 511)]


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_matches_transformers_default(ref, proc, hw):
    im = rand_image(*hw, seed=hw[0] * 7 + hw[1])
    out = proc([im])
    assert_same(out, ref_call(ref, [im]))
    t, gh, gw = out.grid_thw[0].tolist()
    assert out.sizes == [(gh * 16, gw * 16)]
    assert out.num_tokens == [t * gh * gw // 4]
    assert out.pixel_values.shape[1] == 3 * 2 * 16 * 16


@pytest.mark.parametrize("hw,mn,mx", [
    ((997, 1000), 32 * 32, 256 * 256),       # downscale branch
    ((1280, 720), 32 * 32, 300 * 300),       # downscale, non-square budget
    ((57, 300), 32 * 32, 16777216),          # pure rounding, no min-pixel upscale
    ((300, 57), 512 * 512, 1024 * 1024),     # upscale branch
    ((640, 480), 640 * 480, 640 * 480),      # min == max
])
def test_matches_transformers_per_call_pixels(ref, proc, hw, mn, mx):
    im = rand_image(*hw, seed=1)
    out = proc([im], min_pixels=mn, max_pixels=mx)
    assert_same(out, ref_call(ref, [im], mn, mx))
    h, w = out.sizes[0]
    assert h * w <= mx or (h, w) == (32, 32)


def test_batch_matches_transformers(ref, proc):
    # Two same-shaped images exercise transformers' shape grouping; order must survive it.
    ims = [
        rand_image(120, 200, 1),
        rand_image(64, 64, 2),
        rand_image(120, 200, 3),
        rand_image(301, 77, 4)
    ]
    out = proc(ims)
    assert_same(out, ref_call(ref, ims))
    assert sum(out.num_tokens) * 4 == out.pixel_values.shape[0]


def test_per_image_min_max(ref, proc):
    ims = [rand_image(400, 600, 1), rand_image(400, 600, 2), rand_image(90, 150, 3)]
    mins = [None, 32 * 32, 128 * 128]
    maxs = [64 * 64 * 4, None, 200 * 200]
    out = proc(ims, min_pixels=mins, max_pixels=maxs)
    rows = 0
    for i, im in enumerate(ims):
        theirs = ref_call(ref, [im], mins[i], maxs[i])
        n = theirs["pixel_values"].shape[0]
        assert out.grid_thw[i].tolist() == theirs["image_grid_thw"][0].tolist()
        diff = (out.pixel_values[rows:rows + n] - theirs["pixel_values"]).abs().max().item()
        assert diff <= TOL
        rows += n
    assert rows == out.pixel_values.shape[0]
    with pytest.raises(ValueError, match="entries for 3 images"):
        proc(ims, min_pixels=[None, None])


def test_non_rgb_input_matches_transformers(ref, proc):
    rgba = rand_image(100, 140, 5, mode="RGBA")
    a = np.array(rgba)
    a[..., 3] = np.random.default_rng(5).integers(0, 256, a.shape[:2])
    rgba = PIL.Image.fromarray(a, "RGBA")
    for im in (rgba, rand_image(100, 140, 6, mode="L"), rand_image(100, 140, 7, mode="P")):
        assert_same(proc([im]), ref_call(ref, [im]))


def test_token_count_without_processing(ref, proc):
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        n = proc.num_image_tokens(h, w)
        assert n * 4 == ref.get_number_of_image_patches(h, w)
        assert proc.grid_thw(h, w)[1] * 16 == proc.resized_size(h, w)[0]
    im = rand_image(333, 222, 1)
    assert proc([im]).num_tokens == [proc.num_image_tokens(333, 222)]
    assert proc.num_image_tokens(333, 222,
                                 max_pixels=64 * 64) == proc([im], max_pixels=64 * 64).num_tokens[0]


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(1, 20000, 2))
        mn = int(rng.integers(1, 200_000))
        mx = int(rng.integers(mn, 20_000_000))
        if max(h, w) / min(h, w) > 200:
            continue
        theirs = hf_smart_resize(h, w, 32, mn, mx)
        # where transformers keeps max_pixels, the grids are the same
        if theirs[0] * theirs[1] <= mx:
            assert smart_resize(h, w, 32, mn, mx) == theirs


@pytest.mark.parametrize("hw, mn, mx, expected", [
    # below min_pixels, min above max: transformers gives 256x256
    ((10, 10), 65536, 50000, (192, 192)),
    # upscale to min rounds both sides past a max just above it
    ((20, 300), 65536, 66000, (64, 992)),
    ((300, 57), 65536, 70000, (576, 96)),     # the same, the other orientation
    # aspect ratio 200: one side stays 32, the other must shrink
    ((40, 8000), 1024, 10240, (32, 320)),
])
def test_max_pixels_is_an_upper_bound(proc, hw, mn, mx, expected):
    theirs = hf_smart_resize(*hw, 32, mn, mx)
    assert theirs[0] * theirs[1] > mx  # the cases transformers lets past max_pixels
    h, w = smart_resize(*hw, 32, mn, mx)
    assert (h, w) == expected and h * w <= mx and h % 32 == 0 and w % 32 == 0
    out = proc([rand_image(*hw, seed=4)], min_pixels=mn, max_pixels=mx)
    assert out.sizes == [expected] and out.num_tokens == [h * w // 1024]
    assert out.pixel_values.shape[0] == h * w // 256


def test_max_pixels_below_one_patch_window_is_refused(proc):
    with pytest.raises(ValueError, match="max_pixels=1000 is below one 32x32 patch window"):
        proc([rand_image(64, 64)], max_pixels=1000)
    assert proc([rand_image(64, 64)], max_pixels=1024, min_pixels=1).sizes == [(32, 32)]


def test_detail_sets_the_pixel_budget(proc):
    ims = [rand_image(800, 800, 1), rand_image(800, 800, 2), rand_image(800, 800, 3)]
    # low: at most LOW_DETAIL_MAX_PIXELS = 512 x 512; high and auto (and unset): max_pixels as
    # configured.
    out = proc(ims, detail=["low", "high", None])
    assert out.sizes == [(512, 512), (800, 800), (800, 800)] and out.num_tokens == [256, 625, 625]
    assert proc(ims[:1], detail="auto").sizes == proc(ims[:1]).sizes == [(800, 800)]
    # the smaller budget wins
    assert proc(ims[:1], detail="low", max_pixels=256 * 256).sizes == [(256, 256)]
    assert proc(ims[:1], detail="high", max_pixels=256 * 256).sizes == [(256, 256)]
    assert proc.max_pixels_for("low") == 512 * 512 and proc.max_pixels_for(
        "high") == proc.max_pixels
    with pytest.raises(ValueError, match="detail must be one of auto, low, high, got 'medium'"):
        proc(ims[:1], detail="medium")


def test_validation(proc):
    with pytest.raises(ValueError, match="aspect ratio"):
        proc([rand_image(2, 500)])
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 32, 1, 10**9)
    with pytest.raises(ValueError, match="smaller than the patch factor"):
        smart_resize(10, 10, 32, 0, 10**6)
    # max_pixels wins over a larger min_pixels (here as in transformers).
    assert smart_resize(1000, 1000, 32, 65536, 4096) == hf_smart_resize(
        1000, 1000, 32, 65536, 4096) == (64, 64)
    with pytest.raises(TypeError, match="load_image"):
        proc([np.zeros((32, 32, 3), np.uint8)])


def test_single_image_and_empty(proc):
    out = proc(rand_image(64, 64))
    assert len(out) == 1 and out.grid_thw.shape == (1, 3)
    empty = proc([])
    assert empty.pixel_values.shape == (0, 1536) and empty.grid_thw.shape == (0,
                                                                              3) and len(empty) == 0


def test_temporal_repeat_and_layout(proc):
    # One image fills its temporal patch by repetition: the two T halves of every row are identical.
    out = proc([rand_image(64, 96, 3)])
    rows = out.pixel_values.view(-1, 3, 2, 16, 16)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])


def test_from_config(tmp_path):
    p = Qwen3VLImageProcessor.from_config_dict(QWEN3_VL_CONFIG)
    assert (p.patch_size, p.temporal_patch_size, p.merge_size, p.min_pixels, p.max_pixels) == \
        (16, 2, 2, 65536, 16777216)
    legacy = Qwen3VLImageProcessor.from_config_dict(
        {**QWEN3_VL_CONFIG, "min_pixels": 1024, "max_pixels": 4096})
    assert (legacy.min_pixels, legacy.max_pixels) == (1024, 4096)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**QWEN3_VL_CONFIG, "patch_size": 14}))
    assert Qwen3VLImageProcessor.from_pretrained(tmp_path).patch_size == 14
    # No settings in the checkpoint: the published values (the class defaults), as the video
    # processor does.
    assert Qwen3VLImageProcessor.from_pretrained(tmp_path / "nope").patch_size == 16
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "processor_config.json").write_text(
        json.dumps({
            "image_processor": {**QWEN3_VL_CONFIG, "patch_size": 14}, "video_processor": {"fps": 3}
        }))
    assert Qwen3VLImageProcessor.from_pretrained(tmp_path / "nested").patch_size == 14


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_transformers_on_cuda(ref, proc):
    ims = [rand_image(480, 640, 1), rand_image(57, 300, 2)]
    out = proc(ims, device="cuda")
    assert out.pixel_values.device.type == "cuda"
    assert_same(out, ref_call(ref, ims, device="cuda"))


# -------------------------------------------------------------------------------------------------
# image_io

def png_bytes(im, **kw):
    buf = io.BytesIO()
    im.save(buf, "PNG", **kw)
    return buf.getvalue()


def test_input_forms(tmp_path):
    im = rand_image(40, 60, 9)
    data = png_bytes(im)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    arr = np.array(im)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    hwc = torch.from_numpy(arr)
    forms = [str(path), path, data, bytearray(data), uri, im, hwc, hwc.permute(2, 0, 1),
             hwc.permute(2, 0, 1).float() / 255, arr]
    for src in forms:
        out = load_image(src)
        assert out.mode == "RGB" and out.size == (60, 40), type(src)
        assert np.array_equal(np.array(out), arr), type(src)


def test_tensor_gray_and_rgba():
    rng = np.random.default_rng(3)
    g = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    assert np.array_equal(np.array(load_image(torch.from_numpy(g))), np.repeat(g[..., None], 3, -1))
    rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    expect = hf_convert_to_rgb(PIL.Image.fromarray(rgba, "RGBA"), return_numpy=True)
    assert np.array_equal(np.array(load_image(torch.from_numpy(rgba).permute(2, 0, 1))), expect)
    with pytest.raises(ImageLoadError, match=r"\[0, 1\]"):
        load_image(torch.full((3, 8, 8), 2.0))
    with pytest.raises(ImageLoadError, match="channel"):
        load_image(torch.zeros(8, 8, 8, dtype=torch.uint8))


def test_exif_orientation():
    im = rand_image(40, 80, 4)  # landscape pixels
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    data = buf.getvalue()
    out = load_image(data)
    assert out.size == (40, 80)  # displayed upright: portrait
    expect = PIL.ImageOps.exif_transpose(PIL.Image.open(io.BytesIO(data))).convert("RGB")
    assert np.array_equal(np.array(out), np.array(expect))
    # An already-opened PIL image gets the same treatment (transformers' load_image does this too).
    assert np.array_equal(np.array(load_image(PIL.Image.open(io.BytesIO(data)))), np.array(expect))


def _conversion_cases():
    rng = np.random.default_rng(11)
    rgb = rng.integers(0, 256, (24, 36, 3), dtype=np.uint8)
    a = rng.integers(0, 256, (24, 36), dtype=np.uint8)
    rgba = PIL.Image.fromarray(np.dstack([rgb, a]), "RGBA")
    la = PIL.Image.fromarray(np.dstack([a, rgb[..., 0]]), "LA")
    p = PIL.Image.fromarray(rgb).convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=16)
    p_trans = p.copy()
    p_trans.info["transparency"] = 3
    cmyk = PIL.Image.frombytes("CMYK", (36, 24),
                               rng.integers(0, 256, (24, 36, 4), dtype=np.uint8).tobytes())
    i16 = PIL.Image.fromarray(rng.integers(0, 65536, (24, 36), dtype=np.uint16))
    i16_low = PIL.Image.fromarray(rng.integers(0, 256, (24, 36), dtype=np.uint16))
    i32 = PIL.Image.fromarray(rng.integers(-100, 400, (24, 36), dtype=np.int32))
    gray = PIL.Image.fromarray(a)
    return {"RGBA": rgba, "LA": la, "P": p, "P+transparency": p_trans, "CMYK": cmyk, "I;16": i16,
            "I;16 low": i16_low, "I": i32, "L": gray}


@pytest.mark.parametrize("name", list(_conversion_cases()))
def test_conversion_equals_transformers(name):
    im = _conversion_cases()[name]
    assert np.array_equal(np.array(load_image(im)), hf_convert_to_rgb(im, return_numpy=True))


def test_conversion_through_png_bytes():
    # Palette transparency as it really arrives: a tRNS chunk in a PNG file.
    for name in ("P+transparency", "LA", "I;16", "RGBA"):
        im = _conversion_cases()[name]
        data = png_bytes(im, transparency=3) if name == "P+transparency" else png_bytes(im)
        expect = hf_convert_to_rgb(PIL.Image.open(io.BytesIO(data)), return_numpy=True)
        assert np.array_equal(np.array(load_image(data)), expect), name


def test_corrupt_inputs(tmp_path):
    with pytest.raises(ImageLoadError, match="cannot identify"):
        load_image(b"this is not an image")
    truncated = png_bytes(rand_image(64, 64, 1))[:200]
    with pytest.raises(ImageLoadError, match="corrupt or truncated"):
        load_image(truncated)
    with pytest.raises(ImageLoadError, match="not found"):
        load_image(tmp_path / "missing.png")
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0garbage")
    with pytest.raises(ImageLoadError):
        load_image(str(bad))
    with pytest.raises(ImageLoadError, match="base64"):
        load_image("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(ImageLoadError, match="base64 data URIs"):
        load_image("data:image/png,rawdata")
    with pytest.raises(ImageLoadError, match="no data"):
        load_image(b"")
    with pytest.raises(TypeError):
        load_image(12345)


def test_url_refused_by_default():
    with pytest.raises(ImageLoadError, match="URL loading is off"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ValueError):
        load_image("HTTP://example.com/cat.png")


def test_url_fetch_local_server():
    data = png_bytes(rand_image(30, 50, 2))
    server = ImageServer(data)
    try:
        url = f"{server.url}/x.png"
        # The server's checks (vlinfer/multimodal/url_fetch.py): loopback is refused unless the
        # policy allows it.
        with pytest.raises(ImageLoadError, match="non-public address 127.0.0.1"):
            load_image(url, url_policy=UrlPolicy())
        assert load_image(url, url_policy=UrlPolicy(allow_private=True, timeout=5)).size == (50, 30)
        with pytest.raises(ImageLoadError, match="over the limit"):
            load_image(url, url_policy=UrlPolicy(allow_private=True, max_bytes=len(data) - 1))
    finally:
        server.close()


def _png_header_only(w, h):
    """A PNG that claims w x h RGB pixels but carries (almost) no data: what a decompression bomb's
    header looks like, without spending memory to build a real one."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(
        b"IEND", b"")


def test_decompression_bomb():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning must not leak out
        # Over our limit but under PIL's hard limit: our error, named with the pixel count and the
        # limit.
        with pytest.raises(ImageLoadError, match=r"100000000 pixels, over the limit of 50000000"):
            load_image(_png_header_only(10000, 10000), max_image_pixels=50_000_000)
        # Over PIL's own hard limit: still our error type, not PIL's.
        with pytest.raises(ImageLoadError, match=r"400000000 pixels"):
            load_image(_png_header_only(20000, 20000))
        # Applies to already-decoded inputs too.
        with pytest.raises(ImageLoadError, match="over the limit of 100"):
            load_image(rand_image(20, 20), max_image_pixels=100)
        with pytest.raises(ImageLoadError, match="over the limit of 100"):
            load_image(torch.zeros(3, 20, 20, dtype=torch.uint8), max_image_pixels=100)


def test_content_hash():
    im = rand_image(30, 40, 8)
    same = load_image(png_bytes(im))
    assert image_content_hash(im) == image_content_hash(same)
    h = image_content_hash(im)
    assert isinstance(h, int) and 0 <= h < 2**64
    a = np.array(im)
    a[0, 0, 0] ^= 1
    assert image_content_hash(PIL.Image.fromarray(a)) != h
    reshaped = PIL.Image.fromarray(np.array(im).reshape(40, 30, 3))  # same bytes, different size
    assert image_content_hash(reshaped) != h
    assert image_content_hash(im.convert("RGBA")) != h
