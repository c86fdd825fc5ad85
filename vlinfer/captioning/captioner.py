"""Batch captioning: a folder / glob / list of images in, one JSON line per image out.

The output is the state: every finished batch is appended and fsync'ed before the next one starts,
so a run killed at any point loses at most the batch in flight, and `resume=True` skips every path
already recorded (captions and errors alike). A batch is one `LLM.chat` call, i.e. one engine run
with continuous batching; an unreadable image is rejected on its own (RequestError.outputs) and
recorded with its error while the rest of the batch is captioned.
"""
import logging
import time
from dataclasses import dataclass, replace

from vlinfer.captioning.inputs import CaptionInputError, is_video, key
from vlinfer.captioning.output import (OutputWriter, check_output, is_parquet, recorded,
                                       recorded_errors, skipped_note)
from vlinfer.caption_records import RECORD_FIELDS, make_record
from vlinfer.config import CAPTION_MAX_TOKENS, DESCRIBE_IMAGE_PROMPT, DESCRIBE_VIDEO_PROMPT
from vlinfer.inputs.limits import text_only
from vlinfer.outputs import RequestError
from vlinfer.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULT_PROMPT = DESCRIBE_IMAGE_PROMPT
DEFAULT_VIDEO_PROMPT = DESCRIBE_VIDEO_PROMPT

logger = logging.getLogger("vlinfer")


def image_limits(llm, max_pixels: int | None) -> dict | None:
    """mm_processor_kwargs for "at most max_pixels per image". Qwen3-VL's resize (here as in
    transformers) scales a small image *up* to min_pixels (64K by default) even past a smaller
    per-request max_pixels, so lower min_pixels with it: a caller asking for few image tokens gets
    few."""
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
        rate = f"{self.captioned / self.seconds:.2f} img/s, " \
            f"{self.tokens / self.seconds:.1f} tok/s" if self.seconds > 0 else "-"
        text = (
            f"captioned {self.captioned} image(s), {self.errors} error(s) in {self.seconds:.1f}s "
            f"({rate}) "
            f"-> {self.out}")
        return text + skipped_note(self.skipped, self.previous_errors)


def check_caption_output(out: str, resume: bool, overwrite: bool) -> None:
    """What caption_files refuses about `out`, checked before a model loads (output.check_output),
    and a Parquet output: a clip's record has more fields than an image's, and one Parquet schema
    does not fit both."""
    if is_parquet(out):
        raise CaptionInputError(
            f"--out {out!r}: the captioner writes a JSONL file; Parquet parts are the Ray "
            "captioner's (--ray)")
    check_output(out, resume, overwrite)


def caption_files(llm, paths: list[str], out: str, prompt: str = DEFAULT_PROMPT,
                  batch_size: int = 8, sampling_params: SamplingParams | None = None,
                  max_pixels: int | None = None, resume: bool = False, overwrite: bool = False,
                  progress: bool = True, json_schema: dict | str | None = None,
                  video_prompt: str | None = None, video_options: dict | None = None,
                  lora_request=None,
                  disable_any_whitespace: bool = StructuredOutputsParams.disable_any_whitespace
                  ) -> CaptionSummary:
    """Caption `paths` with `llm` (an LLM, or a Pipeline: its .llm is used) into the JSONL file
    `out`. With json_schema (a JSON schema, dict or string), every caption is generated under it
    (structured outputs) and recorded as the parsed JSON value. Paths with a video extension
    (VIDEO_EXTENSIONS) are captioned as clips, in the same batches as the images: with video_prompt
    (default: `prompt` when one is given, else DEFAULT_VIDEO_PROMPT) and video_options (fps,
    num_frames, max_frames, video_max_pixels, ...: the video processor's per-request keys).
    lora_request: the LoRARequest every caption runs with (a Pipeline(lora=...) brings its own).
    disable_any_whitespace: no free whitespace in json_schema's JSON (StructuredOutputsParams')."""
    if getattr(llm, "lora_request", None) is not None:
        if lora_request is not None:
            raise ValueError(
                "this Pipeline runs its own adapter (Pipeline(lora=...)): give lora_request only "
                "with "
                "an LLM")
        lora_request = llm.lora_request
    llm = getattr(llm, "llm", llm)
    if not llm.engine.is_multimodal:
        raise ValueError(
            f"{text_only(llm.engine.source.name, 'images')}; use a vision model such as "
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
    # an unknown key or a bad value fails here, before any file is read
    VideoOptions.of(video_options)
    params = sampling_params or SamplingParams(temperature=0.0, max_tokens=CAPTION_MAX_TOKENS)
    if json_schema is not None:  # a bad schema fails here, before any image is read
        params = replace(params, structured_outputs=StructuredOutputsParams(
            json=json_schema, disable_any_whitespace=disable_any_whitespace))
    mm_kwargs = image_limits(llm, max_pixels)
    check_caption_output(out, resume, overwrite)
    done = {key(r["path"]): r for r in recorded(out, resume, overwrite)}
    todo = [p for p in paths if key(p) not in done]
    skipped, previous_errors = len(paths) - len(todo), recorded_errors(map(key, paths), done)
    from tqdm.auto import tqdm
    captioned = errors = tokens = 0
    start = time.perf_counter()
    with OutputWriter(out, RECORD_FIELDS) as writer, \
            tqdm(total=len(todo), unit="img", desc="caption", disable=not progress,
                 dynamic_ncols=True) as bar:
        for begin in range(0, len(todo), batch_size):
            batch = todo[begin:begin + batch_size]
            # A clip's options ride on its own part (chat reads fps, num_frames ... there), so one
            # chat call mixes clips and images; the images' max_pixels in mm_processor_kwargs leaves
            # the clips alone.
            conversations = [[{
                "role": "user", "content": [{"type": "video", "video": path, **video_options},
                                            {"type": "text", "text": video_prompt}]
            }] if is_video(path) else [{
                "role": "user", "content": [{"type": "image", "image": path},
                                            {"type": "text", "text": prompt}]
            }] for path in batch]
            try:
                outputs = llm.chat(conversations, params, use_tqdm=False,
                                   mm_processor_kwargs=mm_kwargs, lora_request=lora_request)
            # some images were unreadable; the rest of the batch still ran
            except RequestError as e:
                outputs = e.outputs
            records = [make_record(path, output, json_schema is not None, is_video(path))
                       for path, output in zip(batch, outputs)]
            writer.write(records)
            for record in records:
                errors += record["error"] is not None
                captioned += record["error"] is None
                tokens += record["tokens"]
            # images/s is the bar's own rate; tokens/s goes in the postfix
            elapsed = time.perf_counter() - start
            bar.set_postfix({"tok/s": f"{tokens / elapsed:.1f}", "errors": errors}, refresh=False)
            bar.update(len(batch))
    return CaptionSummary(len(paths), skipped, captioned, errors, tokens,
                          time.perf_counter() - start, out, previous_errors)
