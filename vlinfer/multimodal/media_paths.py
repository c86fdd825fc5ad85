"""Media named by paths, as the batch jobs and Pipeline.caption take them: a folder gives its image
files, a pattern its matches, a .txt file its list; each path once, keyed as a resumed run knows it.
"""
import glob
import os
from collections.abc import Iterable

# a folder's videos are read beside its images
from vlinfer.multimodal.video_io import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
GLOB_CHARS = "*?["


class CaptionInputError(ValueError):
    """The inputs or the output of a batch job cannot be used (nothing matched, a table without the
    column asked for, a corrupt output file, ...)."""


def _read_list_file(list_file: str) -> list[str]:
    """One path per line; blank lines and '#' comments skipped. A relative path is taken from the
    current folder when it exists there, else from the list file's folder (lists written by `find`
    and lists kept beside their images both work)."""
    base = os.path.dirname(os.path.abspath(list_file))
    paths = []
    with open(list_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not os.path.isabs(line) and not os.path.exists(line) and os.path.exists(
                    os.path.join(base, line)):
                line = os.path.join(base, line)
            paths.append(line)
    return paths


def collect_images(inputs: Iterable[str], videos: bool = False) -> list[str]:
    """Expand CLI inputs into image paths, in order, each once. A folder gives its image files (by
    extension, sorted, not recursive), and its video files too with videos=True; a pattern with * ?
    [ gives its sorted matches (** recurses); a .txt file is a list of paths; anything else is taken
    as an image path as given (a missing one is recorded as an error later, like any unreadable
    image)."""
    paths: list[str] = []
    extensions = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if videos else ())
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name) for name in os.listdir(item)
                if name.lower().endswith(extensions) and os.path.isfile(os.path.join(item, name)))
            if not found:
                kind = "image or video" if videos else "image"
                raise CaptionInputError(
                    f"no {kind} files ({', '.join(extensions)}) in folder {item!r}")
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
        if key(path) not in seen:  # the same image twice would be captioned (and recorded) twice
            seen.add(key(path))
            unique.append(os.path.normpath(path))
    if not unique:
        raise CaptionInputError("no images to caption")
    return unique


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def key(path: str) -> str:
    """What a record is known by when a run resumes: a local path made absolute, a remote one as
    given."""
    return path if is_remote(path) else os.path.abspath(path)
