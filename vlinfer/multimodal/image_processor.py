"""Qwen3-VL image preprocessing: PIL image -> flat patch rows + (t, h, w) grid for the vision
encoder.

Reference: transformers' torchvision ("fast") `Qwen2VLImageProcessor`, which AutoImageProcessor
picks for model
type qwen3_vl. We repeat its numerics step for step so pixel_values match it to float32 rounding:
  uint8 CHW tensor -> tvF.resize(bicubic, antialias) on uint8 -> fused (x - mean/s) / (std/s) in
  float32 -> patchify.
Decoding/RGB conversion stays in PIL (image_io); everything after it is tensor ops on the requested
device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch
from torchvision.transforms.v2 import functional as tvF

from vlinfer.multimodal.processor_config import read_processor_config
from vlinfer.multimodal.image_io import convert_to_rgb

# transformers rejects aspect ratios above this in smart_resize; so do we.
MAX_ASPECT_RATIO = 200

# PIL resample codes (as stored in preprocessor_config.json) -> torchvision modes, the mapping
# transformers uses.
_PIL_TO_TV = {
    0: tvF.InterpolationMode.NEAREST_EXACT,
    1: tvF.InterpolationMode.LANCZOS,
    2: tvF.InterpolationMode.BILINEAR,
    3: tvF.InterpolationMode.BICUBIC,
    4: tvF.InterpolationMode.BOX,
    5: tvF.InterpolationMode.HAMMING,
}


# OpenAI's image `detail`. "low" caps an image at 512 x 512 pixels, the size OpenAI's low detail
# uses: at most 256 image tokens with Qwen3-VL's 32-pixel merge windows, against up to 16384 under
# the model's own max_pixels. "high" and "auto" keep max_pixels as configured (the checkpoint's, or
# the request's mm_processor_kwargs).
LOW_DETAIL_MAX_PIXELS = 512 * 512
DETAILS = ("auto", "low", "high")


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Target (h, w): both multiples of `factor`, h*w <= max_pixels, and >= min_pixels where
    max_pixels allows, aspect ratio kept as closely as possible. max_pixels is a hard bound and wins
    whenever both cannot hold (a min_pixels above it, or an upscale that rounding pushes past it).

    The arithmetic is transformers' qwen2_vl smart_resize (round, then floor/ceil after a uniform
    rescale), so the grids are the same wherever transformers' own result is within max_pixels.
    Where it is not, we differ: transformers' upscale to min_pixels rounds both sides up past a
    max_pixels just above min_pixels (a small image then comes out larger than max_pixels), and its
    downscale keeps a side at `factor` for extreme aspect ratios even when the other side then
    overshoots. Here an upscale that overshoots is redone as the downscale to max_pixels, and a side
    at `factor` shortens the other to fit."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width} has aspect ratio {ratio:.1f}, over the limit of "
                         f"{MAX_ASPECT_RATIO}")
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels={max_pixels} is below one {factor}x{factor} patch window "
                         f"({factor * factor} pixels), the smallest image the model takes")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
        # Only with a side clamped to `factor` (aspect ratio near the limit): shorten the other one.
        if h_bar * w_bar > max_pixels:
            if h_bar == factor:
                w_bar = max_pixels // (factor * factor) * factor
            else:
                h_bar = max_pixels // (factor * factor) * factor
    if h_bar < factor or w_bar < factor:
        # Only reachable with min_pixels <= 0 (a side rounds to 0 and nothing scales it back up).
        raise ValueError(
            f"image {height}x{width} resizes to {h_bar}x{w_bar}, smaller than the patch factor "
            f"{factor}; raise min_pixels")
    return h_bar, w_bar


@dataclass
class ProcessedImages:
    # float32 [sum(t*h*w), 3 * temporal_patch * patch * patch], on the requested device
    pixel_values: torch.Tensor
    # long [N, 3], on CPU: shape metadata the scheduler/rope code reads as Python ints
    grid_thw: torch.Tensor
    sizes: list[tuple[int, int]]  # resized (h, w) per image
    num_tokens: list[int]        # LLM placeholder tokens per image: t*h*w // merge**2

    def __len__(self) -> int:
        return len(self.sizes)


class Qwen3VLImageProcessor:
    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), min_pixels: int = 65536,
                 max_pixels: int = 16777216, resample: int = 3, do_resize: bool = True,
                 do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True):
        if resample not in _PIL_TO_TV:
            raise ValueError(
                f"unsupported resample code {resample}; expected one of {sorted(_PIL_TO_TV)}")
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.merge_size = int(merge_size)
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)
        self.interpolation = _PIL_TO_TV[resample]
        self.do_resize = do_resize
        self.do_rescale = do_rescale
        self.rescale_factor = float(rescale_factor)
        self.do_normalize = do_normalize
        # Resized sides must split into whole merge windows of whole patches.
        self.factor = self.patch_size * self.merge_size
        self.patch_dim = 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    # ----------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_config_dict(cls, d: dict) -> "Qwen3VLImageProcessor":
        """From a preprocessor_config.json dict. Unknown keys (processor_class,
        image_processor_type, ...) are ignored. Legacy top-level min_pixels/max_pixels override
        size, as transformers' __init__ does."""
        kw = {
            k: d[k]
            for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                      "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize")
            if d.get(k) is not None
        }
        size = d.get("size") or {}
        if size.get("shortest_edge") is not None:
            kw["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge") is not None:
            kw["max_pixels"] = size["longest_edge"]
        for key in ("min_pixels", "max_pixels"):
            if d.get(key) is not None:
                kw[key] = d[key]
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, folder) -> "Qwen3VLImageProcessor":
        """The checkpoint's image processor settings; the class defaults when it has none."""
        d = read_processor_config(folder, "image_processor")
        return cls() if d is None else cls.from_config_dict(d)

    # ---------------------------------------------------------------------------------------------
    # sizing

    def resized_size(self, height: int, width: int, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int]:
        """(h, w) an image of this size is resized to, without touching pixels."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ValueError(
                    f"do_resize is off but image {height}x{width} is not a multiple of "
                    f"{self.factor}"
                )
            return height, width
        return smart_resize(height, width, self.factor,
                            self.min_pixels if min_pixels is None else int(min_pixels),
                            self.max_pixels if max_pixels is None else int(max_pixels))

    def grid_thw(self, height: int, width: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int, int]:
        """Patch grid (t, h, w) of one image. t is 1: a still image is one temporal patch (its frame
        repeated)."""
        h, w = self.resized_size(height, width, min_pixels, max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, height: int, width: int, min_pixels: int | None = None,
                         max_pixels: int | None = None) -> int:
        """LLM placeholder tokens for an image of this original size (each merge x merge patch
        window is one)."""
        t, h, w = self.grid_thw(height, width, min_pixels, max_pixels)
        return t * h * w // (self.merge_size ** 2)

    # ---------------------------------------------------------------------------------------------
    # processing

    def max_pixels_for(self, detail: str | None, max_pixels: int | None = None) -> int:
        """An image's pixel budget under OpenAI's `detail` (see LOW_DETAIL_MAX_PIXELS)."""
        if detail not in (None, *DETAILS):
            raise ValueError(f"detail must be one of {', '.join(DETAILS)}, got {detail!r}")
        budget = self.max_pixels if max_pixels is None else int(max_pixels)
        return min(budget, LOW_DETAIL_MAX_PIXELS) if detail == "low" else budget

    def __call__(self, images, device="cpu", min_pixels=None, max_pixels=None,
                 detail=None) -> ProcessedImages:
        """Preprocess a list of PIL images. min_pixels / max_pixels / detail: None (config values;
        detail "auto"), one value for all images, or a list with one entry (or None) per image."""
        if isinstance(images, PIL.Image.Image):
            images = [images]
        n = len(images)
        mins = self._per_image(min_pixels, n, "min_pixels")
        details = self._per_image(detail, n, "detail")
        maxs = [
            self.max_pixels_for(d, m)
            for d, m in zip(details, self._per_image(max_pixels, n, "max_pixels"))
        ]
        device = torch.device(device)

        # Size every image first so a bad one fails the call before any pixel work or device upload.
        for i, image in enumerate(images):
            if not isinstance(image, PIL.Image.Image):
                raise TypeError(f"image {i} is a {type(image).__name__}, expected PIL.Image.Image "
                                "(decode it with vlinfer.multimodal.image_io.load_image)")
        sizes = [
            self.resized_size(im.height, im.width, mins[i], maxs[i]) for i, im in enumerate(images)
        ]

        rows, grids, tokens = [], [], []
        for image, (h, w) in zip(images, sizes):
            x = self._to_tensor(image, device)
            if (h, w) != tuple(x.shape[-2:]):
                x = tvF.resize(x, [h, w], interpolation=self._interpolation(device), antialias=True)
            x = self._rescale_normalize(x)
            rows.append(self._patchify(x))
            t, gh, gw = 1, h // self.patch_size, w // self.patch_size
            grids.append((t, gh, gw))
            tokens.append(t * gh * gw // (self.merge_size ** 2))

        pixel_values = torch.cat(rows) if rows else torch.empty(0, self.patch_dim,
                                                                dtype=torch.float32, device=device)
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        return ProcessedImages(pixel_values, grid_thw, sizes, tokens)

    @staticmethod
    def _per_image(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} images")
            return list(value)
        return [value] * n

    def _interpolation(self, device: torch.device):
        # torchvision's LANCZOS only runs on CPU; transformers falls back to BICUBIC elsewhere, and
        # so do we.
        if self.interpolation == tvF.InterpolationMode.LANCZOS and device.type != "cpu":
            return tvF.InterpolationMode.BICUBIC
        return self.interpolation

    @staticmethod
    def _to_tensor(image: PIL.Image.Image, device: torch.device) -> torch.Tensor:
        """uint8 CHW on `device`. The upload is uint8 (4x smaller than float); all math happens on
        the device."""
        arr = np.array(convert_to_rgb(image))  # writable copy; torch warns on read-only buffers
        x = torch.from_numpy(arr).permute(2, 0, 1)
        if device.type == "cpu":
            return x.contiguous()
        return x.to(device, non_blocking=False).contiguous()

    def _rescale_normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 CHW. Rescale and normalize fused the way transformers fuses them: (x - mean/s) /
        (std/s), so the rounding (and thus the result bit for bit, up to op order on the device) is
        the same."""
        x = x.to(torch.float32)
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, device=x.device)
            std = torch.tensor(self.image_std, device=x.device)
            if self.do_rescale:
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            return (x - mean[:, None, None]) / std[:, None, None]
        if self.do_rescale:
            return x * self.rescale_factor
        return x

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[C, H, W] -> [gh*gw, C*T*P*P]. Rows go merge window by merge window (row-major over
        windows, then row-major inside each m x m window) because the encoder's patch merger fuses
        m*m consecutive rows into one LLM token. Each row is channel-major, then the temporal copy,
        then the P x P pixels: the Conv3d patch embedding's weight layout. A still image fills its
        temporal patch by repeating itself T times."""
        c, h, w = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)  # [gh/m, gw/m, m, m, C, T, P, P]
        return x.reshape(gh * gw, c * t * p * p)
