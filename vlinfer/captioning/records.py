"""The caption output: one record per input (its fields and their column types in one table), and the JSONL file
those records go to, whose content is the run's state."""
import json
import logging
import os

logger = logging.getLogger("vlinfer")


class CaptionInputError(ValueError):
    """The inputs or the output file cannot be used (nothing matched, a corrupt output file, ...)."""


# ---- inputs ----
# Every field of an image's caption record, in order, with its column type (Arrow's type names): make_record and
# error_record write exactly these (a clip's record adds VIDEO_FIELDS), and the Ray captioner's columns and Parquet
# schema are built from this one table, so a field added here reaches every output.
IMAGE_RECORD_FIELDS = {"path": "string", "caption": "string", "tokens": "int64", "size": "list<int64>",
                       "num_image_tokens": "int64", "error": "string"}
VIDEO_FIELDS = {"num_frames": "int64", "grid_thw": "list<int64>", "num_video_tokens": "int64", "duration": "double"}
RECORD_FIELDS = {**IMAGE_RECORD_FIELDS, **VIDEO_FIELDS}


def error_record(path: str, error: str, video: bool = False) -> dict:
    """The record of an input that produced no caption."""
    return _record(path=path, caption=None, tokens=0, error=error, video=video)


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
    return _record(path=path, caption=caption, tokens=len(completion.token_ids), size=image.get("size"),
                   num_image_tokens=None if video else image.get("num_tokens"), error=error, video=video,
                   **({name: image.get(name) for name in VIDEO_FIELDS} if video else {}))


def _record(video: bool, **values) -> dict:
    """A record with exactly the fields of its kind, in their order; a value for no field is an error."""
    fields = RECORD_FIELDS if video else IMAGE_RECORD_FIELDS
    unknown = set(values) - set(fields)
    if unknown:
        raise KeyError(f"caption record fields {sorted(unknown)} are not in captioning.records' field table")
    return {name: values.get(name) for name in fields}



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


def write_records(f, records: list[dict]) -> None:
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())  # on disk before the next batch starts: a kill or power cut loses at most one batch
