"""Batch captioning: a folder / glob / list of images in, one JSON line per image out.

The output is the state: every finished batch is appended and fsync'ed before the next one starts, so a run killed
at any point loses at most the batch in flight, and `resume=True` skips every path already recorded (captions and
errors alike). A batch is one `LLM.chat` call, i.e. one engine run with continuous batching; an unreadable image is
rejected on its own (RequestError.outputs) and recorded with its error while the rest of the batch is captioned.
"""
import glob
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from vlinfer.config import CAPTION_MAX_TOKENS
from vlinfer.multimodal.video_io import VIDEO_EXTENSIONS  # a folder's videos are captioned beside its images
from vlinfer.outputs import RequestError
from vlinfer.sampling_params import SamplingParams, StructuredOutputsParams

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
DEFAULT_PROMPT = "Describe this image."
DEFAULT_VIDEO_PROMPT = "Describe this video."
GLOB_CHARS = "*?["

logger = logging.getLogger("vlinfer")


class CaptionInputError(ValueError):
    """The inputs or the output file cannot be used (nothing matched, a corrupt output file, ...)."""


# ---- inputs ----
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


# ---- the output file ----
def read_records(out: str, repair: bool = True) -> list[dict]:
    """The records in an existing JSONL output. A last line cut short by a kill is dropped (and, with repair, cut
    from the file so the next record starts on a clean line); a damaged line anywhere else is an error, since then
    the file is not what a caption run writes."""
    if not os.path.exists(out):
        return []
    with open(out, "rb") as f:
        data = f.read()
    *complete, tail = data.split(b"\n")  # tail: what follows the last newline (b"" when the file ends with one)
    records = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            records.append(_parse_record(line))
        except ValueError as e:
            raise CaptionInputError(f"{out} line {i + 1} is not a caption record ({e}); "
                                    "fix or remove the file, or write to another --out") from e
    fix = None
    if tail.strip():
        try:
            records.append(_parse_record(tail))
            fix = "newline"  # a whole record whose newline never made it
        except ValueError:
            fix = "truncate"
            logger.warning("%s: dropping a truncated last line (%d bytes) left by an interrupted run", out, len(tail))
    if repair and fix:
        with open(out, "r+b") as f:
            if fix == "truncate":
                f.truncate(len(data) - len(tail))
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
    return records


def _parse_record(line: bytes) -> dict:
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        raise ValueError("no 'path' field")
    return record


def check_output(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse to mix two runs in one file by accident: an existing output needs resume or overwrite."""
    if resume and overwrite:
        raise CaptionInputError("pass either --resume or --overwrite, not both")
    if os.path.isdir(out):
        raise CaptionInputError(f"--out {out!r} is a folder; give a file name such as captions.jsonl")
    if os.path.exists(out) and os.path.getsize(out) and not (resume or overwrite):
        raise CaptionInputError(f"{out} already exists; pass --resume to continue it or --overwrite to start over")


def _append(f, records: list[dict]) -> None:
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())  # on disk before the next batch starts: a kill or power cut loses at most one batch


def image_limits(llm, max_pixels: int | None) -> dict | None:
    """mm_processor_kwargs for "at most max_pixels per image". Qwen3-VL's resize (here as in transformers) scales
    a small image *up* to min_pixels (64K by default) even past a smaller per-request max_pixels, so lower
    min_pixels with it: a caller asking for few image tokens gets few."""
    if not max_pixels:
        return None
    llm = getattr(llm, "llm", llm)
    processor = getattr(llm.engine.input_processor, "image_processor", None)
    min_pixels = getattr(processor, "min_pixels", None)
    if min_pixels is not None and min_pixels > max_pixels:
        return {"max_pixels": max_pixels, "min_pixels": max_pixels}
    return {"max_pixels": max_pixels}


# The fields of an image's caption record, in order: make_record and error_record write exactly these (a clip's
# record adds VIDEO_FIELDS), and the Ray captioner's columns and Parquet schema are built from them.
IMAGE_RECORD_FIELDS = ("path", "caption", "tokens", "size", "num_image_tokens", "error")
VIDEO_FIELDS = ("num_frames", "grid_thw", "num_video_tokens", "duration")


def error_record(path: str, error: str, video: bool = False) -> dict:
    """The record of an input that produced no caption."""
    record = {"path": path, "caption": None, "tokens": 0, "size": None, "num_image_tokens": None, "error": error}
    return {**record, **_video_fields({})} if video else record


def make_record(path: str, output, structured: bool = False, video: bool = False) -> dict:
    """One output line. structured (a --json-schema run): the caption is the parsed JSON record the constraint
    produced; an output that does not parse (cut short by max_tokens) is recorded as an error saying so.
    video: the path is a clip; its line also has num_frames (sampled), grid_thw and num_video_tokens, and size is
    each frame's as the model saw it."""
    if output.error:  # one image per request, so the processor's "image 0: " prefix says nothing
        return error_record(path, output.error.removeprefix("video 0: " if video else "image 0: "), video)
    image = (output.videos if video else output.images)[0] if (output.videos if video else output.images) else {}
    completion = output.outputs[0]
    caption, error = completion.text.strip(), None
    if structured:
        try:
            caption = json.loads(completion.text)
        except json.JSONDecodeError as e:
            why = f"finish_reason={completion.finish_reason}"
            if completion.finish_reason == "length":
                why += ": cut short by max_tokens, raise --max-tokens"
            caption, error = None, f"the output is not a complete JSON record ({e}; {why}): {completion.text[:200]!r}"
    record = {"path": path, "caption": caption, "tokens": len(completion.token_ids), "size": image.get("size"),
              "num_image_tokens": None if video else image.get("num_tokens"), "error": error}
    return {**record, **_video_fields(image)} if video else record


def _video_fields(info: dict) -> dict:
    return {name: info.get(name) for name in VIDEO_FIELDS}


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
        raise ValueError(f"model {llm.engine.source.name!r} is a text-only model and cannot caption images; "
                         "use a vision model such as --model qwen3-vl")
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
            _append(f, records)
            for record in records:
                errors += record["error"] is not None
                captioned += record["error"] is None
                tokens += record["tokens"]
            elapsed = time.perf_counter() - start  # images/s is the bar's own rate; tokens/s goes in the postfix
            bar.set_postfix({"tok/s": f"{tokens / elapsed:.1f}", "errors": errors}, refresh=False)
            bar.update(len(batch))
    return CaptionSummary(len(paths), skipped, captioned, errors, tokens, time.perf_counter() - start, out,
                          previous_errors)
