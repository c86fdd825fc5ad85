"""The caption record: one per input, its fields and their column types in one table (output.py
writes them)."""
import json

# Every field of an image's caption record, in order, with its column type (Arrow's type names):
# make_record and error_record write exactly these (a clip's record adds VIDEO_FIELDS), and the Ray
# captioner's columns and Parquet schema are built from this one table, so a field added here
# reaches every output.
IMAGE_RECORD_FIELDS = {
    "path": "string", "caption": "string", "tokens": "int64", "size": "list<int64>",
    "num_image_tokens": "int64", "error": "string"
}
VIDEO_FIELDS = {
    "num_frames": "int64", "grid_thw": "list<int64>", "num_video_tokens": "int64",
    "duration": "double"
}
RECORD_FIELDS = {**IMAGE_RECORD_FIELDS, **VIDEO_FIELDS}


def error_record(path: str, error: str, video: bool = False) -> dict:
    """The record of an input that produced no caption."""
    return _record(path=path, caption=None, tokens=0, error=error, video=video)


def make_record(path: str, output, structured: bool = False, video: bool = False) -> dict:
    """One output line. structured (a --json-schema run): the caption is the parsed JSON record the
    constraint produced; an output that does not parse (cut short by max_tokens) is recorded as an
    error saying so. video: the path is a clip; its line also has num_frames (sampled), grid_thw and
    num_video_tokens, and size is each frame's as the model saw it."""
    if output.error:
        return error_record(path, request_error(output.error, video), video)
    image = (output.videos if video else output.images)[0] if (
        output.videos if video else output.images) else {}
    completion = output.outputs[0]
    caption, error = completion.text.strip(), None
    if structured:
        try:
            caption = json.loads(completion.text)
        except json.JSONDecodeError as e:
            why = f"finish_reason={completion.finish_reason}"
            if completion.finish_reason == "length":
                why += ": cut short by max_tokens, raise --max-tokens"
            caption, error = None, (f"the output is not a complete JSON record ({e}; {why}): "
                                    f"{completion.text[:200]!r}")
    return _record(path=path, caption=caption, tokens=len(completion.token_ids),
                   size=image.get("size"),
                   num_image_tokens=None if video else image.get("num_tokens"), error=error,
                   video=video, **({name: image.get(name)
                                    for name in VIDEO_FIELDS} if video else {}))


def request_error(error: str, video: bool) -> str:
    """A one-media request's error as a record holds it: the processor's "image 0: " prefix says
    nothing there."""
    return error.removeprefix("video 0: " if video else "image 0: ")


def _record(video: bool, **values) -> dict:
    """A record with exactly the fields of its kind, in their order; a value for no field is an
    error."""
    fields = RECORD_FIELDS if video else IMAGE_RECORD_FIELDS
    unknown = set(values) - set(fields)
    if unknown:
        raise KeyError(
            f"caption record fields {sorted(unknown)} are not in caption_records' field table")
    return {name: values.get(name) for name in fields}
