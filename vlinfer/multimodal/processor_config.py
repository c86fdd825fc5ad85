"""The one lookup of a checkpoint's processor settings: the image processor in
preprocessor_config.json, the video processor in video_preprocessor_config.json, or either nested in
the single processor_config.json that newer transformers saves. None when the checkpoint has
neither: the caller's class defaults (the published Qwen3-VL values) apply."""
from __future__ import annotations

import json
from pathlib import Path

FILES = {
    "image_processor": "preprocessor_config.json",
    "video_processor": "video_preprocessor_config.json"
}


def read_processor_config(folder, entry: str) -> dict | None:
    """entry: "image_processor" or "video_processor"."""
    folder = Path(folder)
    path = folder / FILES[entry]
    if path.is_file():
        return json.loads(path.read_text())
    path = folder / "processor_config.json"
    if path.is_file():
        nested = json.loads(path.read_text()).get(entry)
        if isinstance(nested, dict):
            return nested
    return None
