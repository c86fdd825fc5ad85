"""The media of a chat request: image parts found, checked, fetched and decoded under the image
policy, video parts read as bytes (serve/video.py), and mm_processor_kwargs checked, each a 400
naming the field before any decoding. The engine then preprocesses what comes out of here like
LLM.generate's own inputs."""
import asyncio

from vlinfer.inputs.limits import (MM_PROCESSOR_KWARGS, VIDEO_OPTIONS, text_only, too_many_images,
                                   unknown_mm_kwargs)
from vlinfer.serve import security
from vlinfer.serve.errors import ApiError
from vlinfer.serve.video import check_video_options, video_bytes


def check_mm_kwargs(kwargs: dict | None, engine, config) -> None:
    """The table's keys (vlinfer/inputs/limits.py): image sizes (min_pixels, max_pixels), detail and
    the video keys (fps, num_frames, ...; serve/video.py), each checked here so a bad value is a 400
    naming it before anything is decoded."""
    video = {}
    for key, value in (kwargs or {}).items():
        if key in VIDEO_OPTIONS:
            video[key] = value
            continue
        if key not in MM_PROCESSOR_KWARGS:
            raise ApiError(400, unknown_mm_kwargs([key]), param="mm_processor_kwargs")
        if key == "detail":  # OpenAI's image detail, for every image of the request
            if value not in ("low", "high", "auto"):
                raise ApiError(400, "mm_processor_kwargs.detail must be one of low, high, auto",
                               param="mm_processor_kwargs")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or \
                not 1 <= value <= config.images.max_image_pixels:
            raise ApiError(
                400, f"mm_processor_kwargs.{key} must be an integer in "
                f"[1, {config.images.max_image_pixels}]", param="mm_processor_kwargs")
    if video:
        check_video_options(video, engine, config.video)


def content_lists(messages) -> list[tuple[str, list]]:
    """(param prefix, parts) of every message whose content is a list of parts."""
    return [(f"messages.{i}.content", message.content) for i, message in enumerate(messages)
            if isinstance(message.content, list)]


def image_sources(messages, engine, config) -> list[tuple[str, str]]:
    """(url, param) of every image part of a chat request's messages, in order (part_sources)."""
    return part_sources(content_lists(messages), engine, config)


def part_sources(contents, engine, config, field: str = "messages") -> list[tuple[str, str]]:
    """(url, param) of every image part of contents ((param prefix, parts) pairs: content_lists, or
    the score items of /score and /rerank), in order; refuses a text-only model and too many media
    (in the request's `field`) early."""
    sources, videos = [], 0
    for prefix, parts in contents:
        for j, part in enumerate(parts):
            if part.type == "image_url":
                sources.append((part.image_url.url, f"{prefix}.{j}.image_url.url"))
            videos += part.type == "video_url"
    if sources and not engine.is_multimodal:
        raise ApiError(400, text_only(config.served_model_names[0], "images",
                                      engine.input_processor.language_model_only),
                       param=sources[0][1])
    limit = config.images.max_images
    # counted as the engine counts them (vlinfer/inputs/limits.py)
    if len(sources) + videos > limit:
        raise ApiError(400, too_many_images(len(sources) + videos, limit), param=field,
                       code="too_many_images")
    for url, param in sources:
        if security.image_kind(url) == "other":
            raise security.unsupported_source(url, param)
    return sources


def video_sources(contents) -> list[tuple[str, str]]:
    """(url, param) of every video part of contents ((param prefix, parts) pairs), in order."""
    return [(part.video_url.url, f"{prefix}.{j}.video_url.url") for prefix, parts in contents
            for j, part in enumerate(parts) if part.type == "video_url"]


async def fetch_urls(sources, policy: security.ImagePolicy, videos=()) -> dict[str, bytes]:
    """http(s) images and videos by their part's param, fetched concurrently on the event loop (no
    thread waits on a slow server); a video under the video byte limit."""
    jobs = {param: security.fetch_url(url, policy, param)
            for url, param in sources if security.image_kind(url) == "http"}
    jobs.update({param: security.fetch_url(url, policy.for_videos(), param)
                 for url, param in videos if security.image_kind(url) == "http"})
    results = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, results))


def load_images(sources, fetched: dict[str, bytes], policy: security.ImagePolicy) -> list:
    """In a worker thread: every source to a decoded PIL image (data URIs and files read here)."""
    images = []
    for url, param in sources:
        kind = security.image_kind(url)
        if kind == "data":
            data = security.decode_data_uri(url, policy, param)
        elif kind == "file":
            data = security.read_local_file(url, policy, param)
        else:
            data = fetched[param]
        images.append(security.decode_image(data, policy, param))
    return images


def chat_messages(messages, images: list, policy: security.ImagePolicy,
                  fetched: dict[str, bytes]) -> list[dict]:
    """The request's messages as the chat template takes them: images (decoded, in order) and video
    bytes in their parts, "developer" as "system", and earlier tool calls and results kept."""
    images = iter(images)
    out = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, list):
            content = template_parts(message.content, f"messages.{i}.content", images, policy,
                                     fetched)
        else:
            content = message.content or ""
        entry = {"role": role, "content": content}
        # an earlier answer's calls, written back by the template in its own format
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def template_parts(parts, prefix: str, images, policy: security.ImagePolicy,
                   fetched: dict[str, bytes]) -> list[dict]:
    """One content list's parts as the chat template takes them: texts, the next decoded images of
    the iterator `images` (in order), and video bytes."""
    return [{"type": "text", "text": part.text} if part.type == "text" else {
        "type": "video", "video": video_bytes(part.video_url.url, policy,
                                              f"{prefix}.{j}.video_url.url",
                                              fetched.get(f"{prefix}.{j}.video_url.url"))
    } if part.type == "video_url" else
            {"type": "image", "image": next(images), "detail": part.image_url.detail}
            for j, part in enumerate(parts)]
