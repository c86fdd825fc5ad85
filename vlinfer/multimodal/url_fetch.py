"""Fetching an image over http(s): one function for the engine (`LLM(..., allow_image_urls=True)`)
and the server, so both make the same checks.

The host must be allowed and every address it resolves to public (never loopback, private,
link-local such as cloud metadata at 169.254.169.254, ...), unless the policy allows private ones;
the connection goes to the address that was checked, so DNS cannot change it in between; redirects
are checked the same way; proxies from the environment are ignored (a proxy would make the
connection, not the checked address); the body is capped in bytes and the whole fetch in seconds."""
import asyncio
import concurrent.futures
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass

import httpx

DEFAULT_MAX_URL_BYTES = 20 * 2 ** 20
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv6 addresses that embed (and reach) an IPv4 one


class UrlFetchError(ValueError):
    """The URL was refused, or could not be fetched within the policy; the message says which check
    failed."""


@dataclass
class UrlPolicy:
    """What an image URL may reach. The defaults are the engine's (`allow_image_urls=True`): any
    public host."""
    allowed_hosts: tuple[str, ...] = ("*",)  # "*": any public host; "*.example.com": its subdomains
    # let URLs reach loopback / private / link-local addresses (trusted setups only)
    allow_private: bool = False
    timeout: float = 10.0  # seconds for one image: DNS, connect, redirects and the whole body
    max_bytes: int = DEFAULT_MAX_URL_BYTES
    max_redirects: int = 3
    # how a refusal names allowed_hosts
    allowlist_name: str = "the allowed hosts (UrlPolicy.allowed_hosts)"

    def __post_init__(self):
        self.allowed_hosts = tuple(h.strip().lower().strip("[]") for h in self.allowed_hosts
                                   if h.strip())
        if isinstance(self.timeout, bool) or not isinstance(self.timeout,
                                                            (int, float)) or not self.timeout > 0:
            raise ValueError(
                f"UrlPolicy.timeout must be a positive number of seconds, got {self.timeout!r}")
        for name, least in (("max_bytes", 1), ("max_redirects", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"UrlPolicy.{name} must be an int >= {least}, got {value!r}")


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """False for loopback, private, link-local (cloud metadata at 169.254.169.254), CGNAT,
    multicast, reserved and unspecified addresses, including IPv4 ones wrapped in IPv6 (mapped,
    6to4, Teredo, NAT64)."""
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


async def fetch_image_url(url: str, policy: UrlPolicy) -> bytes:
    """GET an image within the policy (see the module docstring); UrlFetchError says why not."""

    async def follow(url: str) -> bytes:
        # trust_env=False: a proxy from the environment would make the connection, not the checked
        # address.
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False,
                                     timeout=policy.timeout) as client:
            for _ in range(policy.max_redirects + 1):
                body_or_next_url = await _get_once(client, url, policy)
                if isinstance(body_or_next_url, bytes):
                    return body_or_next_url
                url = body_or_next_url
            raise UrlFetchError(f"image URL redirected more than {policy.max_redirects} times")

    try:
        return await asyncio.wait_for(follow(url), policy.timeout)  # the whole fetch, not each read
    except asyncio.TimeoutError:
        raise UrlFetchError(
            f"fetching the image URL took longer than {policy.timeout:g}s") from None
    except httpx.HTTPError as e:
        raise UrlFetchError(f"cannot fetch the image URL: {type(e).__name__}: {e}") from None


def fetch_image_url_sync(url: str, policy: UrlPolicy) -> bytes:
    """fetch_image_url for synchronous callers (the engine's input processing). From inside a
    running event loop (a notebook, an async app calling LLM.generate) it runs on a fresh loop in a
    helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fetch_image_url(url, policy))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fetch_image_url(url, policy)).result()


def _check_url(url: str, policy: UrlPolicy) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UrlFetchError(
            f"image URL scheme {parts.scheme!r} is not supported (only http and https)")
    host = (parts.hostname or "").lower()
    if not host:
        raise UrlFetchError("image URL has no host")
    if not host_allowed(host, policy.allowed_hosts):
        raise UrlFetchError(f"image URL host {host!r} is not in {policy.allowlist_name}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UrlFetchError("image URL has an invalid port") from None
    return parts


async def _resolve(host: str, port: int, policy: UrlPolicy) -> str:
    """The address to connect to. Every address the name resolves to must pass: any of them could be
    used."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UrlFetchError(f"cannot resolve image URL host {host!r}: {e}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise UrlFetchError(f"image URL host {host!r} has no address")
    if not policy.allow_private:
        for ip in addresses:
            if not is_public_address(ip):
                raise UrlFetchError(
                    f"image URL host {host!r} resolves to the non-public address {ip}; image URLs "
                    "are fetched from public addresses only")
    return str(addresses[0])


async def _get_once(client: httpx.AsyncClient, url: str, policy: UrlPolicy) -> bytes | str:
    """The body, or the next URL of a redirect."""
    parts = _check_url(url, policy)
    host = parts.hostname.lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = await _resolve(host, port, policy)
    pinned_host = f"[{address}]" if ":" in address else address
    pinned = parts._replace(netloc=f"{pinned_host}:{port}").geturl()
    host_header = parts.netloc.rpartition("@")[2]  # never forward userinfo
    # identity: a compressed body could inflate a thousandfold inside one chunk, before the byte cap
    # sees it.
    request = client.build_request(
        "GET",
        pinned,
        headers={"Host": host_header, "User-Agent": "vlinfer", "Accept-Encoding": "identity"},
        # TLS checks the certificate against host
        extensions={"sni_hostname": host})
    response = await client.send(request, stream=True)
    try:
        if response.status_code in REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise UrlFetchError(f"image URL answered {response.status_code} without a Location")
            return urllib.parse.urljoin(url, location)
        if response.status_code != 200:
            raise UrlFetchError(f"image URL answered HTTP {response.status_code}")
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise UrlFetchError(
                f"image URL body is {length} bytes, over the limit of {policy.max_bytes}")
        chunks, size = [], 0
        async for chunk in response.aiter_raw():  # as sent: never decompressed here
            size += len(chunk)
            if size > policy.max_bytes:  # a server may lie about or omit Content-Length
                raise UrlFetchError(f"image URL body exceeds the limit of {policy.max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        await response.aclose()
