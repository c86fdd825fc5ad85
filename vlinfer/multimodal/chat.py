"""OpenAI-style chat messages with image and video content parts -> template messages + the images
and videos, in order."""
import os
from importlib import resources

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


VIDEO_PART_TYPES = ("video", "video_url")


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Returns (messages whose image parts are reduced to {"type": "image"}, the image sources in
    order)."""
    out, images, videos = split_chat_media(messages)
    if videos:
        raise ValueError("this conversation has video parts; use split_chat_media")
    return out, images


def split_chat_media(messages: list[dict]) -> tuple[list[dict], list, list]:
    """Returns (messages whose image and video parts are reduced to {"type": "image"} / {"type":
    "video"}, the image sources in order, the video sources in order)."""
    out, images, videos = [], [], []
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
            elif kind in IMAGE_PART_TYPES or kind in VIDEO_PART_TYPES:
                media = "image" if kind in IMAGE_PART_TYPES else "video"
                source = part.get(media, part.get(f"{media}_url"))
                if isinstance(source, dict):
                    source = source.get("url")
                if source is None:
                    raise ValueError(
                        f"message {i} part {j}: {'an' if media == 'image' else 'a'} {media} part "
                        "needs "
                        f"'{media}' or '{media}_url': {{'url'}}")
                (images if media == "image" else videos).append(source)
                parts.append({"type": media})
            else:
                raise ValueError(f"message {i} part {j}: unsupported content part type {kind!r}; "
                                 "use 'text', 'image', 'image_url', 'video' or 'video_url'")
        if all(p["type"] == "text" for p in parts):
            # Text-only parts become a plain string: text models' templates expect one.
            out.append({**message, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**message, "content": parts})
    return out, images, videos


def with_video_options(mm_processor_kwargs: dict | None, messages: list[dict]) -> dict | None:
    """mm_processor_kwargs plus what each video part sets beside its source (fps, num_frames,
    max_frames, ...), as per-video lists the video processor reads; a video part without a key keeps
    the kwargs' own value. Run split_chat_media first: it checks the shape this trusts."""
    from vlinfer.multimodal.video_processor import VIDEO_OPTIONS
    parts = [part for message in messages if isinstance(message.get("content"), list)
             for part in message["content"] if part.get("type") in VIDEO_PART_TYPES]
    own = [{k: part[k] for k in VIDEO_OPTIONS if k in part} for part in parts]
    if not any(own):
        return mm_processor_kwargs
    kwargs = dict(mm_processor_kwargs or {})
    for key in {k for d in own for k in d}:
        default = kwargs.get(key)
        defaults = default if isinstance(default, (list, tuple)) else [default] * len(parts)
        kwargs[key] = [d.get(key, fallback) for d, fallback in zip(own, defaults)]
    return kwargs


def image_details(messages: list[dict]) -> list[str | None]:
    """Each image part's OpenAI `detail` ("low", "high", "auto"; None when unset), in image order:
    from image_url.detail, or a "detail" key beside "image" in vlinfer's own image parts. Run
    split_chat_images first: it checks the shape this trusts."""
    details = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") in IMAGE_PART_TYPES:
                url = part.get("image_url")
                details.append(url.get("detail") if isinstance(url, dict) else part.get("detail"))
    return details


def with_image_details(mm_processor_kwargs: dict | None, details: list[str | None]) -> dict | None:
    """mm_processor_kwargs plus the per-image details, where a part set one (the image processor
    turns them into pixel budgets); an image without one keeps the kwargs' own "detail", if any."""
    if all(d is None for d in details):
        return mm_processor_kwargs
    kwargs = dict(mm_processor_kwargs or {})
    default = kwargs.get("detail")
    defaults = default if isinstance(default, (list, tuple)) else [default] * len(details)
    kwargs["detail"] = [d if d is not None else fallback for d, fallback in zip(details, defaults)]
    return kwargs


def message_texts(messages: list[dict], tools: list | None = None):
    """Every text the template puts in the prompt from the caller: content, the names and arguments
    of earlier tool calls, and the tool definitions (as the template writes them, JSON)."""
    import json
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str):
            yield content
        elif content is not None:
            yield from (p["text"] for p in content if p.get("type") == "text")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            yield str(function.get("name", ""))
            arguments = function.get("arguments", "")
            yield arguments if isinstance(arguments, str) else json.dumps(arguments)
    if tools:
        yield json.dumps(tools, ensure_ascii=False)


class ToolsNotRenderedError(ValueError):
    """Tools given to a model whose chat template does not read them (the model would never see
    them); model_name says which. Each surface adds its own remedy."""

    def __init__(self, model_name: str, remedy: str):
        self.model_name = model_name
        super().__init__(f"the chat template of model {model_name!r} does not render tools, so the "
                         f"model would never see them; {remedy}")


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (a template that does not would drop them
    silently)."""
    import jinja2
    import jinja2.meta
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


def load_chat_template(folder: str, tokenizer, multimodal: bool) -> str | None:
    """The checkpoint's template (chat_template.jinja / .json, else the tokenizer's); for Qwen3-VL
    checkpoints without one that handles images, the template shipped with vlinfer."""
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
        return resources.files("vlinfer.multimodal").joinpath(
            "templates/qwen3_vl.jinja").read_text()
    return template
