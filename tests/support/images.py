"""Seeded test pictures: a random base colour, a horizontal ramp and per-pixel noise, so two seeds
never collide; and a local HTTP server that hands one out, for the URL-fetch tests."""
import http.server
import threading

import numpy as np
from PIL import Image


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 60, w)[None, :, None] + rng.randint(
        0, 40, (h, w, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


class ImageServer:
    """A local HTTP server: /x.png the image, /slow.png holds the response until released."""

    def __init__(self, data: bytes):
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/slow.png":
                    server.release.wait(30)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
