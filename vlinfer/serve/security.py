"""What stands between a request and the engine: the API key, the body size cap, and image sources.

The engine's load_image opens local paths, so the server never hands it a string: it resolves every
image source itself (base64 data URIs; http(s) URLs only to allowlisted hosts that resolve to public
addresses, through the fetch LLM(..., allow_image_urls=True) uses too,
vlinfer/multimodal/url_fetch.py; file:// URLs only below one root) and passes decoded PIL images on.
"""
import base64
import binascii
import hmac
import io
import os
import stat
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import PIL.Image

from vlinfer.inputs.limits import MAX_IMAGE_PIXELS, MAX_IMAGES, too_many_pixels
from vlinfer.multimodal.image_io import ImageLoadError, load_image
from vlinfer.multimodal.url_fetch import UrlFetchError, UrlPolicy, fetch_image_url
from vlinfer.serve.errors import ApiError, error_body
from vlinfer.serve.limits import MAX_IMAGE_BYTES, MAX_VIDEO_BYTES


# ---- API key ----
def check_api_key(headers: dict[bytes, bytes], api_key: str) -> str | None:
    """None when authorized, else the reason. compare_digest: the comparison takes the same time
    wherever the first wrong byte is, so the key cannot be guessed byte by byte from response times.
    """
    value = headers.get(b"authorization", b"")
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token.strip(), api_key.encode()):
        return "invalid API key"
    return None


# ---- the outermost layer: auth, body cap, and the per-status request count ----
class GuardMiddleware:
    """Pure ASGI (no per-request task or buffering beyond the capped body): checks the API key
    before reading any body, reads the body with a cap (413 past it, also for chunked uploads
    without Content-Length), replays it to the app, and counts every response by route and status,
    errors included."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, on_response=None,
                 protected_prefixes: tuple[str, ...] = ("/v1/", "/v2/", "/score", "/rerank")):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response  # (path, status, method) -> None
        self.protected_prefixes = protected_prefixes  # the API; /health and /metrics stay open

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_counted)
        finally:
            if self.on_response is not None:
                self.on_response(scope["path"], status[0], scope["method"])

    async def _handle(self, scope, receive, send):
        headers = dict(scope["headers"])  # ASGI header names are lower-case bytes
        if self.api_key and scope["path"].startswith(self.protected_prefixes):
            reason = check_api_key(headers, self.api_key)
            if reason:
                return await send_error(send, 401, reason, code="invalid_api_key",
                                        headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        too_big = f"the request body is larger than the limit of {limit} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(send, 413, too_big, code="request_too_large", close=True)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_error(send, 413, too_big, code="request_too_large", close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            # The body once, then the real receive: it reports the client's disconnect to whoever
            # waits for it.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def send_error(send, status: int, message: str, code: str | None = None, headers=(),
                     close: bool = False):
    body = error_body(status, message, code=code)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *headers]
    if close:  # the rest of an oversized upload is not read: the connection cannot be reused
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- image sources ----
@dataclass
class ImagePolicy:
    max_image_bytes: int = MAX_IMAGE_BYTES
    # one video (a data URI, a file, an http(s) URL): clips outweigh images
    max_video_bytes: int = MAX_VIDEO_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS  # defaults: the table in vlinfer/inputs/limits.py
    max_images: int = MAX_IMAGES
    # empty: http(s) URLs are refused; "*" allows any public host
    allowed_url_hosts: tuple[str, ...] = ()
    allow_private_urls: bool = False
    url_timeout: float = 10.0  # seconds for one image: DNS, connect, redirects and the whole body
    max_redirects: int = 3
    allowed_local_root: str | None = None  # file:// URLs only below this folder; None: refused
    # What OpenAI's API takes, plus BMP. Not "whatever PIL can open": EPS hands the bytes to
    # Ghostscript, and the rarer decoders (TIFF, PSD, ICO, ...) add attack surface for images no
    # client needs to send. (JPEG covers MPO, the multi-picture JPEG some phones write.)
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    _root: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.allowed_url_hosts = tuple(h.strip().lower().strip("[]") for h in self.allowed_url_hosts
                                       if h.strip())
        self.image_formats = tuple(f.strip().upper() for f in self.image_formats if f.strip())
        PIL.Image.init()  # registers every decoder, so the check below knows them all
        unknown = [f for f in self.image_formats if f not in PIL.Image.OPEN]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}; PIL knows {sorted(PIL.Image.OPEN)}")
        if self.allowed_local_root:
            self._root = Path(self.allowed_local_root).resolve(strict=True)

    def for_videos(self) -> "ImagePolicy":
        """The same rules with the video byte limit, for fetching and reading video parts."""
        return replace(self, max_image_bytes=self.max_video_bytes)

    @property
    def url_policy(self) -> UrlPolicy:
        return UrlPolicy(allowed_hosts=self.allowed_url_hosts,
                         allow_private=self.allow_private_urls, timeout=self.url_timeout,
                         max_bytes=self.max_image_bytes, max_redirects=self.max_redirects,
                         allowlist_name="this server's allowlist (--allowed-url-hosts)")


def _bad(message: str, param: str, status: int = 400) -> ApiError:
    return ApiError(status, message, param=param, code="invalid_image")


async def fetch_url(url: str, policy: ImagePolicy, param: str = "url") -> bytes:
    """GET an image over http(s) within the policy, by the fetch the engine uses too
    (url_fetch.fetch_image_url: allowlisted hosts, public addresses, pinned connections, no proxies,
    byte and time limits); its refusals are 400s naming `param`."""
    if not policy.allowed_url_hosts:
        if "video_url" in param:
            raise _bad(
                "video URLs are disabled on this server (--allowed-url-hosts); send the clip "
                "inline as a "
                "base64 data URI (data:video/mp4;base64,...)", param)
        raise _bad(
            "image URLs are disabled on this server; send the image inline as a base64 data URI "
            "(data:image/png;base64,...)", param)
    try:
        return await fetch_image_url(url, policy.url_policy)
    except UrlFetchError as e:
        raise _bad(str(e), param) from None


def decode_data_uri(uri: str, policy: ImagePolicy, param: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise _bad("malformed data URI: no ',' between header and payload", param)
    options = header[5:].lower().split(";")
    if "base64" not in options:
        raise _bad("only base64 data URIs are supported (data:image/png;base64,...)", param)
    if options[0] and not options[0].startswith("image/"):
        raise _bad(f"data URI media type is {options[0]!r}, not an image", param)
    if len(payload
           ) > 4 * (policy.max_image_bytes // 3 + 2) + payload.count("\n") + payload.count("\r"):
        raise _bad(f"image is larger than the limit of {policy.max_image_bytes} bytes", param)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"data URI payload is not valid base64: {e}", param) from None
    if len(data) > policy.max_image_bytes:
        raise _bad(f"image is {len(data)} bytes, over the limit of {policy.max_image_bytes}", param)
    return data


def read_local_file(url: str, policy: ImagePolicy, param: str) -> bytes:
    """file:// URL -> bytes, only for a regular file below allowed_local_root after resolving '..'
    and symlinks."""
    if policy._root is None:
        raise _bad("file:// image URLs are disabled on this server (see --allowed-local-root)",
                   param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad("file:// URLs must be absolute: file:///path/to/image.png", param)
    raw = urllib.parse.unquote(parts.path)
    if "\x00" in raw:
        raise _bad("file URL path contains a NUL byte", param)
    # resolves '..' and symlinks, so the check below sees the real location
    target = Path(raw).resolve()
    if not target.is_relative_to(policy._root):
        raise _bad("file URL is outside the folder this server may read images from", param)
    try:
        # O_NOFOLLOW: the resolved path has no symlink left; one swapped in since is refused, not
        # followed. O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise _bad(f"image file not found or not readable: {raw}", param) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _bad(f"not a regular file: {raw}", param)
    with os.fdopen(fd, "rb") as f:
        data = f.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise _bad(f"image file is larger than the limit of {policy.max_image_bytes} bytes", param)
    return data


def decode_image(data: bytes, policy: ImagePolicy, param: str) -> PIL.Image.Image:
    """Bytes -> RGB PIL image. Only the policy's decoders ever parse the bytes (formats=), and the
    pixel cap is checked from the header before any pixel is decoded; then load_image applies EXIF
    orientation and the RGB conversion exactly as it does for the engine's other inputs."""
    if not data:
        raise _bad("invalid image: no data", param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        try:
            # reads the header only
            image = PIL.Image.open(io.BytesIO(data), formats=policy.image_formats)
        except PIL.UnidentifiedImageError:
            raise _bad(f"invalid image: not a {' / '.join(policy.image_formats)} image, or corrupt",
                       param) from None
        except PIL.Image.DecompressionBombError as e:
            raise _bad(f"invalid image: {e}", param) from None
        # whatever a parser raises on hostile bytes is a bad image
        except Exception as e:  # noqa: BLE001
            raise _bad(f"invalid image: cannot read its header ({type(e).__name__}: {e})",
                       param) from None
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise _bad(f"invalid image: {too_many_pixels(width, height, policy.max_image_pixels)}",
                   param)
    try:
        image.load()
        return load_image(image, max_image_pixels=policy.max_image_pixels)
    except ImageLoadError as e:
        raise _bad(f"invalid image: {e}", param) from None
    except Exception as e:  # noqa: BLE001
        raise _bad(f"invalid image: corrupt or truncated data ({type(e).__name__}: {e})",
                   param) from None


def image_kind(url: str) -> str:
    head = url[:8].lower()
    if head.startswith("data:"):
        return "data"
    if head.startswith(("http://", "https://")):
        return "http"
    if head.startswith("file:"):
        return "file"
    return "other"


def unsupported_source(url: str, param: str) -> ApiError:
    shown = url if len(url) <= 60 else url[:60] + "..."
    return _bad(
        f"unsupported image URL {shown!r}: use a base64 data URI (data:image/png;base64,...), an "
        "http(s) "
        "URL or a file:// URL (the last two only where this server enables them)", param)
