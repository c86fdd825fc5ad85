"""Everything before the vision tower: image inputs, preprocessing, placeholder expansion, 3-row
positions, content hashes, and chat messages with image parts."""
from vlinfer.multimodal.chat import load_chat_template, split_chat_images
from vlinfer.multimodal.image_io import (DEFAULT_MAX_IMAGE_PIXELS, ImageLoadError, convert_to_rgb,
                                         image_content_hash, load_image)
from vlinfer.multimodal.image_processor import (MAX_ASPECT_RATIO, ProcessedImages,
                                                Qwen3VLImageProcessor, smart_resize)
from vlinfer.multimodal.mrope import mrope_positions
from vlinfer.multimodal.processor import Qwen3VLInputProcessor
from vlinfer.multimodal.url_fetch import DEFAULT_MAX_URL_BYTES, UrlFetchError, UrlPolicy

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_MAX_URL_BYTES", "MAX_ASPECT_RATIO", "ImageLoadError",
    "ProcessedImages", "Qwen3VLImageProcessor", "Qwen3VLInputProcessor", "convert_to_rgb",
    "image_content_hash", "load_chat_template", "load_image", "mrope_positions", "smart_resize",
    "split_chat_images", "UrlFetchError", "UrlPolicy"
]
