"""Batch jobs over files: which inputs a folder, glob, list or table names (inputs.py), the
resumable output they write (output.py), the caption run and its records (captioner.py, records.py)
and the embedding run and its records (embedder.py). `vlinfer caption`, `vlinfer embed`, their Ray
Data jobs and the demo's batch tab share them."""
from vlinfer.captioning.captioner import (DEFAULT_PROMPT, DEFAULT_VIDEO_PROMPT, CaptionSummary,
                                          caption_files, image_limits)
from vlinfer.captioning.embedder import (EMBED_RECORD_FIELDS, EmbedSummary, embed_files, embed_rows,
                                         file_rows, input_rows)
from vlinfer.captioning.inputs import IMAGE_EXTENSIONS, CaptionInputError, collect_images, is_video
from vlinfer.captioning.output import OutputWriter, check_output, read_records, recorded
from vlinfer.caption_records import (IMAGE_RECORD_FIELDS, RECORD_FIELDS, VIDEO_FIELDS,
                                        error_record, make_record)

__all__ = [
    "CaptionInputError", "CaptionSummary", "DEFAULT_PROMPT", "DEFAULT_VIDEO_PROMPT",
    "EMBED_RECORD_FIELDS", "EmbedSummary", "IMAGE_EXTENSIONS", "IMAGE_RECORD_FIELDS",
    "OutputWriter", "RECORD_FIELDS", "VIDEO_FIELDS", "caption_files", "check_output",
    "collect_images", "embed_files", "embed_rows", "error_record", "file_rows", "image_limits",
    "input_rows", "is_video", "make_record", "read_records", "recorded"
]
