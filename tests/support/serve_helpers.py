"""What the server tests share (bench/serving.py and bench/soak.py too): an in-process server on a
free port (uvicorn in a thread around an app, so the caller can look at the engine, its KV pool and
encoder cache, while clients talk HTTP to it), generated PNGs and image bombs, data URIs, and chat
request bodies."""
import threading
import time

import uvicorn


class ServerThread:
    """`with ServerThread(app) as url:` serves app on 127.0.0.1 (port chosen by the OS) and stops it
    on exit."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0):
        # Port 0: the OS picks a free port at bind time, so two test servers can never race for one.
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2, server_header=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="vlinfer-test-server",
                                       daemon=True)
        self.startup_timeout = startup_timeout
        self.url = None

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()


def png_bytes(seed: int = 0, size: tuple[int, int] = (64, 64)) -> bytes:
    """A small random RGB PNG: distinct seeds give distinct images (and distinct encoder cache
    keys)."""
    import io

    import numpy as np
    import PIL.Image
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    import base64
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels but holds almost no data: decoding it would
    allocate width * height * 3 bytes, so a server must refuse it from the header."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(
            ">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def chat_body(text: str = "Describe the image.", images=(), max_tokens: int = 8, **extra) -> dict:
    """An OpenAI chat request body: one user turn, the images (URLs or data URIs) first, then the
    text."""
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content.append({"type": "text", "text": text})
    return {
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, **extra
    }
