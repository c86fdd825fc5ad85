"""The one opener for a media source given as a string, images and videos alike: a base64 `data:`
URI, an http(s) URL (fetched under the server's UrlPolicy, vlinfer/multimodal/url_fetch.py), a
`file://` URL or a local path. image_io.py and video_io.py decode what it returns; each passes its
own error type so a client sees ImageLoadError or VideoLoadError with the same words."""
from __future__ import annotations

import base64
import binascii
from pathlib import Path

from vlinfer.multimodal.url_fetch import UrlFetchError, UrlPolicy, fetch_image_url_sync

# The data URI media types each kind accepts (an empty type, "data:;base64,...", is accepted for
# both).
MEDIA_TYPES = {"image": ("image/",), "video": ("video/", "application/octet-stream")}
ARTICLES = {"image": "an", "video": "a"}


def open_string_source(source: str, kind: str, error: type[ValueError], *,
                       url_policy: UrlPolicy | None,
                       max_bytes: int | None = None) -> tuple[bytes | Path, str]:
    """(the bytes, or the local path to open, and how to name the source in an error). kind: "image"
    or "video". max_bytes bounds a data URI's payload before it is decoded (None: no bound here)."""
    head = source[:16].lower()
    if head.startswith("data:"):
        return parse_data_uri(source, kind, error, max_bytes), "data URI"
    if head.startswith(("http://", "https://")):
        if url_policy is None:
            raise error(
                f"{kind} URL loading is off (allow_image_urls=False); send the {kind} inline as a "
                "base64 "
                "data URI or bytes instead")
        try:
            return fetch_image_url_sync(source, url_policy), short(source)
        except UrlFetchError as e:
            raise error(f"{str(e).replace('image', kind)} ({short(source)})") from None
    if head.startswith("file://"):
        source = source[len("file://"):]
    return Path(source), source


def parse_data_uri(uri: str, kind: str, error: type[ValueError],
                   max_bytes: int | None = None) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise error("malformed data URI: no ',' separating header and payload")
    params = header[5:].lower().split(";")
    if "base64" not in params:
        raise error(f"only base64 data URIs are supported (data:{kind}/...;base64,...)")
    if params[0] and not params[0].startswith(MEDIA_TYPES[kind]):
        raise error(f"data URI media type is {params[0]!r}, not {ARTICLES[kind]} {kind}")
    if max_bytes is not None and len(payload) > 4 * (max_bytes // 3 + 2) + payload.count("\n"):
        raise error(f"{kind} is larger than the limit of {max_bytes} bytes")
    try:
        # Strict alphabet check so garbage is reported as such instead of silently decoding to junk
        # bytes.
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise error(f"data URI payload is not valid base64: {e}") from None


def short(s: str, n: int = 120) -> str:
    return s if len(s) <= n else s[:n] + "..."
