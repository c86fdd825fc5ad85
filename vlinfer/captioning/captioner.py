"""Batch captioning: a folder / glob / list of images in, one JSON line per image out.

The output is the state: every finished batch is appended and fsync'ed before the next one starts, so a run killed
at any point loses at most the batch in flight, and `resume=True` skips every path already recorded (captions and
errors alike). A batch is one `LLM.chat` call, i.e. one engine run with continuous batching; an unreadable image is
rejected on its own (RequestError.outputs) and recorded with its error while the rest of the batch is captioned.
"""
import glob
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from vlinfer.captioning.records import CaptionInputError, check_output, make_record, read_records, write_records
from vlinfer.config import CAPTION_MAX_TOKENS
from vlinfer.inputs.limits import text_only
from vlinfer.multimodal.video_io import VIDEO_EXTENSIONS  # a folder's videos are captioned beside its images
from vlinfer.outputs import RequestError
from vlinfer.sampling_params import SamplingParams, StructuredOutputsParams

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
DEFAULT_PROMPT = "Describe this image."
DEFAULT_VIDEO_PROMPT = "Describe this video."
GLOB_CHARS = "*?["

logger = logging.getLogger("vlinfer")


def is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


def _read_list_file(list_file: str) -> list[str]:
    """One path per line; blank lines and '#' comments skipped. A relative path is taken from the current folder
    when it exists there, else from the list file's folder (lists written by `find` and lists kept beside their
    images both work)."""
    base = os.path.dirname(os.path.abspath(list_file))
    paths = []
    with open(list_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not os.path.isabs(line) and not os.path.exists(line) and os.path.exists(os.path.join(base, line)):
                line = os.path.join(base, line)
            paths.append(line)
    return paths


def collect_images(inputs: Iterable[str], videos: bool = False) -> list[str]:
    """Expand CLI inputs into image paths, in order, each once. A folder gives its image files (by extension,
    sorted, not recursive), and its video files too with videos=True; a pattern with * ? [ gives its sorted
    matches (** recurses); a .txt file is a list of paths; anything else is taken as an image path as given (a
    missing one is recorded as an error later, like any unreadable image)."""
    paths: list[str] = []
    extensions = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if videos else ())
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name) for name in os.listdir(item)
                           if name.lower().endswith(extensions) and os.path.isfile(os.path.join(item, name)))
            if not found:
                kind = "image or video" if videos else "image"
                raise CaptionInputError(f"no {kind} files ({', '.join(extensions)}) in folder {item!r}")
            paths.extend(found)
        elif any(c in item for c in GLOB_CHARS) and not os.path.exists(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not found:
                raise CaptionInputError(f"no files match {item!r}")
            paths.extend(found)
        elif item.lower().endswith(".txt") and os.path.isfile(item):
            paths.extend(_read_list_file(item))
        else:
            paths.append(item)
    seen, unique = set(), []
    for path in paths:
        key = os.path.abspath(path)
        if key not in seen:  # the same image twice would be captioned (and recorded) twice
            seen.add(key)
            unique.append(os.path.normpath(path))
    if not unique:
        raise CaptionInputError("no images to caption")
    return unique


def image_limits(llm, max_pixels: int | None) -> dict | None:
    """mm_processor_kwargs for "at most max_pixels per image". Qwen3-VL's resize (here as in transformers) scales
    a small image *up* to min_pixels (64K by default) even past a smaller per-request max_pixels, so lower
    min_pixels with it: a caller asking for few image tokens gets few."""
    if not max_pixels:
        return None
    llm = getattr(llm, "llm", llm)
    processor = getattr(llm.engine.input_processor.mm_processor, "image_processor", None)
    min_pixels = getattr(processor, "min_pixels", None)
    if min_pixels is not None and min_pixels > max_pixels:
        return {"max_pixels": max_pixels, "min_pixels": max_pixels}
    return {"max_pixels": max_pixels}


# ---- the run ----
@dataclass
class CaptionSummary:
    total: int  # distinct input paths
    skipped: int  # already in the output file (resume)
    captioned: int  # this run
    errors: int  # this run
    tokens: int  # generated this run
    seconds: float
    out: str
    previous_errors: int = 0  # error records among the skipped paths

    def line(self) -> str:
        rate = f"{self.captioned / self.seconds:.2f} img/s, {self.tokens / self.seconds:.1f} tok/s" \
            if self.seconds > 0 else "-"
        text = (f"captioned {self.captioned} image(s), {self.errors} error(s) in {self.seconds:.1f}s ({rate}) "
                f"-> {self.out}")
        if self.skipped:
            text += f"; {self.skipped} already recorded, skipped ({self.previous_errors} of them errors)"
        return text


def caption_files(llm, paths: list[str], out: str, prompt: str = DEFAULT_PROMPT, batch_size: int = 8,
                  sampling_params: SamplingParams | None = None, max_pixels: int | None = None,
                  resume: bool = False, overwrite: bool = False, progress: bool = True,
                  json_schema: dict | str | None = None, video_prompt: str | None = None,
                  video_options: dict | None = None) -> CaptionSummary:
    """Caption `paths` with `llm` (an LLM, or a Pipeline: its .llm is used) into the JSONL file `out`. With
    json_schema (a JSON schema, dict or string), every caption is generated under it (structured outputs) and
    recorded as the parsed JSON value. Paths with a video extension (VIDEO_EXTENSIONS) are captioned as clips,
    in the same batches as the images: with video_prompt (default: `prompt` when one is given, else
    DEFAULT_VIDEO_PROMPT) and video_options (fps, num_frames, max_frames, video_max_pixels, ...: the video
    processor's per-request keys)."""
    llm = getattr(llm, "llm", llm)
    if not llm.engine.is_multimodal:
        raise ValueError(f"{text_only(llm.engine.source.name, 'images')}; use a vision model such as "
                         "--model qwen3-vl")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the caption prompt must be a non-empty string")
    if video_prompt is None:
        video_prompt = DEFAULT_VIDEO_PROMPT if prompt == DEFAULT_PROMPT else prompt
    if not isinstance(video_prompt, str) or not video_prompt.strip():
        raise ValueError("the video caption prompt must be a non-empty string")
    video_options = dict(video_options or {})
    from vlinfer.multimodal.video_processor import VideoOptions
    VideoOptions.of(video_options)  # an unknown key or a bad value fails here, before any file is read
    params = sampling_params or SamplingParams(temperature=0.0, max_tokens=CAPTION_MAX_TOKENS)
    if json_schema is not None:  # a bad schema fails here, before any image is read
        params = replace(params, structured_outputs=StructuredOutputsParams(json=json_schema))
    mm_kwargs = image_limits(llm, max_pixels)
    check_output(out, resume, overwrite)
    done = {}
    if resume:
        done = {os.path.abspath(r["path"]): r for r in read_records(out)}
    elif overwrite and os.path.exists(out):
        os.remove(out)
    todo = [p for p in paths if os.path.abspath(p) not in done]
    skipped = len(paths) - len(todo)
    previous_errors = sum(1 for p in paths if done.get(os.path.abspath(p), {}).get("error"))
    from tqdm.auto import tqdm
    captioned = errors = tokens = 0
    start = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "a", encoding="utf-8") as f, \
            tqdm(total=len(todo), unit="img", desc="caption", disable=not progress, dynamic_ncols=True) as bar:
        for begin in range(0, len(todo), batch_size):
            batch = todo[begin:begin + batch_size]
            # A clip's options ride on its own part (chat reads fps, num_frames ... there), so one chat call
            # mixes clips and images; the images' max_pixels in mm_processor_kwargs leaves the clips alone.
            conversations = [[{"role": "user", "content": [{"type": "video", "video": path, **video_options},
                                                            {"type": "text", "text": video_prompt}]}]
                             if is_video(path) else
                             [{"role": "user", "content": [{"type": "image", "image": path},
                                                           {"type": "text", "text": prompt}]}] for path in batch]
            try:
                outputs = llm.chat(conversations, params, use_tqdm=False, mm_processor_kwargs=mm_kwargs)
            except RequestError as e:  # some images were unreadable; the rest of the batch still ran
                outputs = e.outputs
            records = [make_record(path, output, json_schema is not None, is_video(path))
                       for path, output in zip(batch, outputs)]
            write_records(f, records)
            for record in records:
                errors += record["error"] is not None
                captioned += record["error"] is None
                tokens += record["tokens"]
            elapsed = time.perf_counter() - start  # images/s is the bar's own rate; tokens/s goes in the postfix
            bar.set_postfix({"tok/s": f"{tokens / elapsed:.1f}", "errors": errors}, refresh=False)
            bar.update(len(batch))
    return CaptionSummary(len(paths), skipped, captioned, errors, tokens, time.perf_counter() - start, out,
                          previous_errors)
