"""Image input layer: turn whatever a request carries into one upright RGB PIL image.

Every accepted form ends in the same place (`_finalize`): EXIF orientation applied, then the exact
RGB conversion transformers' image processors apply (alpha composited on white), so the pixels we
feed the vision encoder are the pixels the reference pipeline would feed it. Failures are
`ImageLoadError` (a ValueError) with a message a client can act on, never a bare PIL exception.
"""
from __future__ import annotations

import hashlib
import io
import re
import warnings
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch

from vlinfer.inputs.limits import MAX_IMAGE_PIXELS, too_many_pixels
from vlinfer.multimodal.source_open import open_string_source
from vlinfer.multimodal.url_fetch import UrlPolicy

# The table's limit (vlinfer/inputs/limits.py). PIL's own limits (warn above Image.MAX_IMAGE_PIXELS,
# raise above twice that) stay in force under ours; a deployment that needs more must raise PIL's
# process-wide limit too.
DEFAULT_MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

_PIL_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageLoadError(ValueError):
    """The input could not be turned into an image (unreadable, corrupt, too large, refused source).
    """


def load_image(source, *, url_policy: UrlPolicy | None = None,
               max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> PIL.Image.Image:
    """Decode `source` into an RGB PIL image.

    source: a file path (str or Path), raw bytes, a base64 `data:` URI, an http(s) URL (only with a
    url_policy: fetched as the server fetches, vlinfer/multimodal/url_fetch.py), a PIL image, or a
    uint8 / float-in-[0,1] tensor or ndarray laid out CHW, HWC or HW. max_image_pixels: width*height
    limit checked from the header before decoding (None: only PIL's own limit).
    """
    if isinstance(source, PIL.Image.Image):
        _check_pixels(source.size, max_image_pixels)
        return _finalize(source)
    if isinstance(source, (torch.Tensor, np.ndarray)):
        return _finalize(_array_to_pil(source, max_image_pixels))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), "bytes", max_image_pixels)
    if isinstance(source, Path):
        return _open_path(source, max_image_pixels)
    if isinstance(source, str):
        opened, what = open_string_source(source, "image", ImageLoadError, url_policy=url_policy)
        if isinstance(opened, Path):
            return _open_path(opened, max_image_pixels)
        return _decode(opened, what, max_image_pixels)
    raise TypeError(
        f"unsupported image source type {type(source).__name__}; expected path, bytes, data URI, "
        "URL, PIL.Image or tensor")


def convert_to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB exactly as transformers' `image_transforms.convert_to_rgb` does it for PIL input.

    Anything with an alpha band or palette transparency is composited on opaque white; everything
    else (L, P, CMYK, I;16, I, F, ...) goes through PIL's own `convert("RGB")`. Note PIL clips
    16/32-bit values to 0..255 rather than rescaling them; transformers inherits that, and so do we,
    to see the same pixels.
    """
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def image_content_hash(image: PIL.Image.Image) -> int:
    """64-bit content key (unsigned) over mode, size and pixel bytes: equal pixels give equal keys,
    whatever the source form, so prefix-cache and encoder-cache entries can be shared across
    requests."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return int.from_bytes(h.digest(), "little")


# -------------------------------------------------------------------------------------------------
# internals

def _finalize(image: PIL.Image.Image) -> PIL.Image.Image:
    """EXIF orientation then RGB. exif_transpose returns a copy, so the caller's image is never
    mutated."""
    try:
        image = PIL.ImageOps.exif_transpose(image)
        return convert_to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # Lazy decoders surface truncated/corrupt data here, on first pixel access.
        raise ImageLoadError(f"cannot decode image: {e}") from e


def _check_pixels(size: tuple[int, int], limit: int | None) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ImageLoadError(f"image has an empty size {w}x{h}")
    if limit is not None and w * h > limit:
        raise ImageLoadError(too_many_pixels(w, h, limit))


def _decode(data: bytes, what: str, limit: int | None) -> PIL.Image.Image:
    if not data:
        raise ImageLoadError(f"cannot read image from {what}: no data")
    return _open(io.BytesIO(data), what, limit)


def _open_path(path: Path, limit: int | None) -> PIL.Image.Image:
    if not path.is_file():
        raise ImageLoadError(f"image file not found: {path}")
    return _open(path, str(path), limit)


def _open(fp, what: str, limit: int | None) -> PIL.Image.Image:
    # Image.open reads only the header, so the size check below runs before any pixel is decoded.
    # PIL's own bomb check also runs inside open(): silence its warning (ours is the error that
    # matters) and translate its error.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        try:
            image = PIL.Image.open(fp)
        except PIL.Image.DecompressionBombError as e:
            m = _PIL_BOMB_PIXELS.search(str(e))
            pixels = m.group(1) if m else "too many"
            pil_limit = 2 * (PIL.Image.MAX_IMAGE_PIXELS or 0)
            eff = pil_limit if limit is None else min(limit, pil_limit)
            raise ImageLoadError(
                f"image from {what} is {pixels} pixels, over the limit of {eff} pixels; "
                "possible decompression bomb") from e
        except PIL.UnidentifiedImageError as e:
            raise ImageLoadError(
                f"cannot identify image format of {what} (not an image, or an unsupported "
                "format)") from e
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageLoadError(f"cannot read image from {what}: {e}") from e
        with image:
            _check_pixels(image.size, limit)
            try:
                image.load()
            except (OSError, SyntaxError, ValueError, EOFError) as e:
                raise ImageLoadError(f"corrupt or truncated image data in {what}: {e}") from e
            return _finalize(image)


def _array_to_pil(x, limit: int | None) -> PIL.Image.Image:
    """CHW / HWC / HW tensor or ndarray, uint8 or float in [0, 1], 1/3/4 channels -> L / RGB / RGBA
    PIL image."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.detach()
    if t.ndim == 2:
        t = t.unsqueeze(-1)
    elif t.ndim == 3:
        # Channels-first wins a tie (e.g. 3x3x3), the same rule transformers'
        # infer_channel_dimension_format uses.
        if t.shape[0] in (1, 3, 4):
            t = t.permute(1, 2, 0)
        elif t.shape[-1] not in (1, 3, 4):
            raise ImageLoadError(
                f"cannot tell the channel dim of an image tensor of shape {tuple(t.shape)}; "
                "expected CHW or HWC with 1, 3 or 4 channels")
    else:
        raise ImageLoadError(f"image tensor must be 2-D or 3-D, got shape {tuple(t.shape)}")
    h, w = t.shape[0], t.shape[1]
    _check_pixels((w, h), limit)
    if t.dtype == torch.uint8:
        pass
    elif t.is_floating_point():
        t = t.float()
        lo, hi = float(t.min()), float(t.max())
        if not (0.0 <= lo and hi <= 1.0):
            raise ImageLoadError(f"float image tensor must hold values in [0, 1], got [{lo}, {hi}]")
        # Round, not truncate: the nearest uint8 level is the closest reading of the caller's float
        # pixel.
        t = (t * 255.0).round().to(torch.uint8)
    else:
        raise ImageLoadError(f"image tensor dtype must be uint8 or floating point, got {t.dtype}")
    arr = np.ascontiguousarray(t.cpu().numpy())
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[-1]]
    if mode == "L":
        arr = arr[..., 0]
    return PIL.Image.frombuffer(mode, (w, h), arr.tobytes(), "raw", mode, 0, 1)
