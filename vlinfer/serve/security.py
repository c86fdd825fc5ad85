"""What stands between a request and the engine: the API key, the body size cap, and image sources.

The engine's load_image trusts its caller (it opens local paths and, when allowed, any URL), so the server never
hands it a string: it resolves every image source itself (base64 data URIs; http(s) URLs only to allowlisted hosts
that resolve to public addresses, the connection pinned to the checked address; file:// URLs only below one root)
and passes decoded PIL images on."""
import asyncio
import base64
import binascii
import hmac
import io
import ipaddress
import os
import socket
import stat
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import PIL.Image

from vlinfer.multimodal.image_io import ImageLoadError, load_image
from vlinfer.serve.protocol import ApiError, error_body

REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv6 addresses that embed (and reach) an IPv4 one


# ---- API key ----
def check_api_key(headers: dict[bytes, bytes], api_key: str) -> str | None:
    """None when authorized, else the reason. compare_digest: the comparison takes the same time wherever the
    first wrong byte is, so the key cannot be guessed byte by byte from response times."""
    value = headers.get(b"authorization", b"")
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token.strip(), api_key.encode()):
        return "invalid API key"
    return None


# ---- the outermost layer: auth, body cap, and the per-status request count ----
class GuardMiddleware:
    """Pure ASGI (no per-request task or buffering beyond the capped body): checks the API key before reading any
    body, reads the body with a cap (413 past it, also for chunked uploads without Content-Length), replays it to
    the app, and counts every response by route and status, errors included."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, on_response=None,
                 protected_prefix: str = "/v1/"):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response  # (path, status, method) -> None
        self.protected_prefix = protected_prefix

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
        if self.api_key and scope["path"].startswith(self.protected_prefix):
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
            # The body once, then the real receive: it reports the client's disconnect to whoever waits for it.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def send_error(send, status: int, message: str, code: str | None = None, headers=(), close: bool = False):
    body = error_body(status, message, code=code)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:  # the rest of an oversized upload is not read: the connection cannot be reused
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- image sources ----
@dataclass
class ImagePolicy:
    max_image_bytes: int = 20 * 2 ** 20
    max_image_pixels: int = 1 << 25  # 32 Mi pixels, e.g. 8192 x 4096: ~100 MB once decoded to RGB
    max_images: int = 16
    allowed_url_hosts: tuple[str, ...] = ()  # empty: http(s) URLs are refused; "*" allows any public host
    allow_private_urls: bool = False
    url_timeout: float = 10.0  # seconds for one image: DNS, connect, redirects and the whole body
    max_redirects: int = 3
    allowed_local_root: str | None = None  # file:// URLs only below this folder; None: refused
    # What OpenAI's API takes, plus BMP. Not "whatever PIL can open": EPS hands the bytes to Ghostscript, and the
    # rarer decoders (TIFF, PSD, ICO, ...) add attack surface for images no client needs to send.
    # (JPEG covers MPO, the multi-picture JPEG some phones write.)
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    _root: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.allowed_url_hosts = tuple(h.strip().lower().strip("[]") for h in self.allowed_url_hosts if h.strip())
        self.image_formats = tuple(f.strip().upper() for f in self.image_formats if f.strip())
        PIL.Image.init()  # registers every decoder, so the check below knows them all
        unknown = [f for f in self.image_formats if f not in PIL.Image.OPEN]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}; PIL knows {sorted(PIL.Image.OPEN)}")
        if self.allowed_local_root:
            self._root = Path(self.allowed_local_root).resolve(strict=True)


def _bad(message: str, param: str, status: int = 400) -> ApiError:
    return ApiError(status, message, param=param, code="invalid_image")


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """False for loopback, private, link-local (cloud metadata at 169.254.169.254), CGNAT, multicast, reserved and
    unspecified addresses, including IPv4 ones wrapped in IPv6 (mapped, 6to4, Teredo, NAT64)."""
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        if entry == "*" or host == entry or (entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False


async def _resolve(host: str, port: int, policy: ImagePolicy, param: str) -> str:
    """The address to connect to. Every address the name resolves to must pass: any of them could be used."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise _bad(f"cannot resolve image URL host {host!r}: {e}", param) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise _bad(f"image URL host {host!r} has no address", param)
    if not policy.allow_private_urls:
        for ip in addresses:
            if not is_public_address(ip):
                raise _bad(f"image URL host {host!r} resolves to the non-public address {ip}; the server only "
                           "fetches from public addresses", param)
    return str(addresses[0])


def _check_url(url: str, policy: ImagePolicy, param: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise _bad(f"image URL scheme {parts.scheme!r} is not supported (only http and https)", param)
    host = (parts.hostname or "").lower()
    if not host:
        raise _bad("image URL has no host", param)
    if not host_allowed(host, policy.allowed_url_hosts):
        raise _bad(f"image URL host {host!r} is not in this server's allowlist (--allowed-url-hosts)", param)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise _bad("image URL has an invalid port", param) from None
    return parts


async def fetch_url(url: str, policy: ImagePolicy, param: str = "url") -> bytes:
    """GET an image over http(s) within the policy: allowlisted hosts only, public addresses only (the connection
    goes to the address that was checked, so DNS cannot change it in between), redirects re-checked the same way,
    at most max_image_bytes, at most url_timeout seconds in all."""
    if not policy.allowed_url_hosts:
        raise _bad("image URLs are disabled on this server; send the image inline as a base64 data URI "
                   "(data:image/png;base64,...)", param)

    async def follow(url: str) -> bytes:
        # trust_env=False: a proxy from the environment would make the connection, not the checked address.
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=policy.url_timeout) as client:
            for _ in range(policy.max_redirects + 1):
                body_or_next_url = await _get_once(client, url, policy, param)
                if isinstance(body_or_next_url, bytes):
                    return body_or_next_url
                url = body_or_next_url
            raise _bad(f"image URL redirected more than {policy.max_redirects} times", param)

    try:
        return await asyncio.wait_for(follow(url), policy.url_timeout)  # the whole fetch, not each read
    except asyncio.TimeoutError:
        raise _bad(f"fetching the image URL took longer than {policy.url_timeout:g}s", param) from None
    except httpx.HTTPError as e:
        raise _bad(f"cannot fetch the image URL: {type(e).__name__}: {e}", param) from None


async def _get_once(client: httpx.AsyncClient, url: str, policy: ImagePolicy, param: str) -> bytes | str:
    """The body, or the next URL of a redirect."""
    parts = _check_url(url, policy, param)
    host = parts.hostname.lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = await _resolve(host, port, policy, param)
    pinned_host = f"[{address}]" if ":" in address else address
    pinned = parts._replace(netloc=f"{pinned_host}:{port}").geturl()
    host_header = parts.netloc.rpartition("@")[2]  # never forward userinfo
    # identity: a compressed body could inflate a thousandfold inside one chunk, before the byte cap sees it.
    request = client.build_request("GET", pinned, headers={"Host": host_header, "User-Agent": "vlinfer-server",
                                                           "Accept-Encoding": "identity"},
                                   extensions={"sni_hostname": host})  # TLS checks the certificate against host
    response = await client.send(request, stream=True)
    try:
        if response.status_code in REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise _bad(f"image URL answered {response.status_code} without a Location", param)
            return urllib.parse.urljoin(url, location)
        if response.status_code != 200:
            raise _bad(f"image URL answered HTTP {response.status_code}", param)
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > policy.max_image_bytes:
            raise _bad(f"image URL body is {length} bytes, over the limit of {policy.max_image_bytes}", param)
        chunks, size = [], 0
        async for chunk in response.aiter_raw():  # as sent: never decompressed here
            size += len(chunk)
            if size > policy.max_image_bytes:  # a server may lie about or omit Content-Length
                raise _bad(f"image URL body exceeds the limit of {policy.max_image_bytes} bytes", param)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        await response.aclose()


def decode_data_uri(uri: str, policy: ImagePolicy, param: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise _bad("malformed data URI: no ',' between header and payload", param)
    options = header[5:].lower().split(";")
    if "base64" not in options:
        raise _bad("only base64 data URIs are supported (data:image/png;base64,...)", param)
    if options[0] and not options[0].startswith("image/"):
        raise _bad(f"data URI media type is {options[0]!r}, not an image", param)
    if len(payload) > 4 * (policy.max_image_bytes // 3 + 2) + payload.count("\n") + payload.count("\r"):
        raise _bad(f"image is larger than the limit of {policy.max_image_bytes} bytes", param)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"data URI payload is not valid base64: {e}", param) from None
    if len(data) > policy.max_image_bytes:
        raise _bad(f"image is {len(data)} bytes, over the limit of {policy.max_image_bytes}", param)
    return data


def read_local_file(url: str, policy: ImagePolicy, param: str) -> bytes:
    """file:// URL -> bytes, only for a regular file below allowed_local_root after resolving '..' and symlinks."""
    if policy._root is None:
        raise _bad("file:// image URLs are disabled on this server (see --allowed-local-root)", param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad("file:// URLs must be absolute: file:///path/to/image.png", param)
    raw = urllib.parse.unquote(parts.path)
    if "\x00" in raw:
        raise _bad("file URL path contains a NUL byte", param)
    target = Path(raw).resolve()  # resolves '..' and symlinks, so the check below sees the real location
    if not target.is_relative_to(policy._root):
        raise _bad("file URL is outside the folder this server may read images from", param)
    try:
        # O_NOFOLLOW: the resolved path has no symlink left; one swapped in since is refused, not followed.
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
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
    """Bytes -> RGB PIL image. Only the policy's decoders ever parse the bytes (formats=), and the pixel cap is
    checked from the header before any pixel is decoded; then load_image applies EXIF orientation and the RGB
    conversion exactly as it does for the engine's other inputs."""
    if not data:
        raise _bad("invalid image: no data", param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        try:
            image = PIL.Image.open(io.BytesIO(data), formats=policy.image_formats)  # reads the header only
        except PIL.UnidentifiedImageError:
            raise _bad(f"invalid image: not a {' / '.join(policy.image_formats)} image, or corrupt", param) from None
        except PIL.Image.DecompressionBombError as e:
            raise _bad(f"invalid image: {e}", param) from None
        except Exception as e:  # noqa: BLE001 - whatever a parser raises on hostile bytes is a bad image
            raise _bad(f"invalid image: cannot read its header ({type(e).__name__}: {e})", param) from None
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise _bad(f"invalid image: {width}x{height} = {width * height} pixels, over the limit of "
                   f"{policy.max_image_pixels} pixels; possible decompression bomb", param)
    try:
        image.load()
        return load_image(image, max_image_pixels=policy.max_image_pixels)
    except ImageLoadError as e:
        raise _bad(f"invalid image: {e}", param) from None
    except Exception as e:  # noqa: BLE001
        raise _bad(f"invalid image: corrupt or truncated data ({type(e).__name__}: {e})", param) from None


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
    return _bad(f"unsupported image URL {shown!r}: use a base64 data URI (data:image/png;base64,...), an http(s) "
                "URL or a file:// URL (the last two only where this server enables them)", param)
