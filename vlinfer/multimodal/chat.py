"""OpenAI-style chat messages with image content parts -> template messages + the images, in order."""
import os
from importlib import resources

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Returns (messages whose image parts are reduced to {"type": "image"}, the image sources in order)."""
    out, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
        content = message.get("content", "")
        if isinstance(content, str):
            out.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError(f"message {i} content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in IMAGE_PART_TYPES:
                source = part.get("image", part.get("image_url"))
                if isinstance(source, dict):
                    source = source.get("url")
                if source is None:
                    raise ValueError(f"message {i} part {j}: an image part needs 'image' or 'image_url': {{'url'}}")
                images.append(source)
                parts.append({"type": "image"})
            else:
                raise ValueError(f"message {i} part {j}: unsupported content part type {kind!r}; "
                                 "use 'text', 'image' or 'image_url'")
        if all(p["type"] == "text" for p in parts):
            # Text-only parts become a plain string: text models' templates expect one.
            out.append({**message, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**message, "content": parts})
    return out, images


def image_details(messages: list[dict]) -> list[str | None]:
    """Each image part's OpenAI `detail` ("low", "high", "auto"; None when unset), in image order: from
    image_url.detail, or a "detail" key beside "image" in vlinfer's own image parts. Run split_chat_images first:
    it checks the shape this trusts."""
    details = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") in IMAGE_PART_TYPES:
                url = part.get("image_url")
                details.append(url.get("detail") if isinstance(url, dict) else part.get("detail"))
    return details


def with_image_details(mm_processor_kwargs: dict | None, details: list[str | None]) -> dict | None:
    """mm_processor_kwargs plus the per-image details, where a part set one (the image processor turns them into
    pixel budgets); an image without one keeps the kwargs' own "detail", if any."""
    if all(d is None for d in details):
        return mm_processor_kwargs
    kwargs = dict(mm_processor_kwargs or {})
    default = kwargs.get("detail")
    defaults = default if isinstance(default, (list, tuple)) else [default] * len(details)
    kwargs["detail"] = [d if d is not None else fallback for d, fallback in zip(details, defaults)]
    return kwargs


def message_texts(messages: list[dict]):
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str):
            yield content
        else:
            yield from (p["text"] for p in content if p.get("type") == "text")


def load_chat_template(folder: str, tokenizer, multimodal: bool) -> str | None:
    """The checkpoint's template (chat_template.jinja / .json, else the tokenizer's); for Qwen3-VL checkpoints
    without one that handles images, the template shipped with vlinfer."""
    for name in ("chat_template.jinja", "chat_template.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            if name.endswith(".json"):
                import json
                text = json.loads(text)["chat_template"]
            return text
    template = getattr(tokenizer, "chat_template", None)
    if multimodal and (not template or "vision_start" not in template):
        return resources.files("vlinfer.multimodal").joinpath("templates/qwen3_vl.jinja").read_text()
    return template
