"""Captioning files in bulk: which inputs a folder, glob or list names, the record written per image or video, and
the resumable run over them (`vlinfer caption`, the Ray Data captioner, the demo's batch tab)."""
from vlinfer.captioning.captioner import (DEFAULT_PROMPT, DEFAULT_VIDEO_PROMPT, IMAGE_EXTENSIONS, CaptionInputError,
                                          CaptionSummary, caption_files, check_output, collect_images, image_limits,
                                          is_video)
from vlinfer.captioning.records import (IMAGE_RECORD_FIELDS, RECORD_FIELDS, VIDEO_FIELDS, error_record, make_record,
                                        read_records)

__all__ = ["CaptionInputError", "CaptionSummary", "DEFAULT_PROMPT", "DEFAULT_VIDEO_PROMPT", "IMAGE_EXTENSIONS",
           "IMAGE_RECORD_FIELDS", "RECORD_FIELDS", "VIDEO_FIELDS", "caption_files", "check_output", "collect_images",
           "error_record", "image_limits", "is_video", "make_record", "read_records"]
