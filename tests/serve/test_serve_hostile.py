"""Hostile requests against the server: each gets the right 4xx status and a clear OpenAI-shaped
error, and the server answers a normal request right after. Three in-process servers share one
engine:

- `main`: small limits (1 MiB body, 256 KiB image), an allowlist naming private hosts (so the
  private-address
  check, not the allowlist, is what refuses them), file:// URLs below a temp folder;
- `default`: the default policy (image URLs and file URLs off);
- `private`: --allow-private-urls with 127.0.0.1 allowlisted and a 1 s URL timeout, against a local
  HTTP server
  that is slow, oversized, redirects, or serves a real image.

HOSTILE_CASES is the table; the count of hostile cases is len(HOSTILE_CASES) + the separate tests
marked `hostile` below (see test_count_of_hostile_cases)."""
import http.server
import io
import json
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import PIL.Image
import pytest

from dependencies import REPO

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.serve import ImagePolicy, ServeConfig, build_app
from serve_helpers import ServerThread, chat_body, data_uri, png_bomb, png_bytes

MODEL = "qwen3-vl-tiny"
MAX_BODY = 1 << 20
MAX_IMAGE = 256 << 10
PRIVATE_HOSTS = ("localhost", "127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "::ffff:127.0.0.1",
                 "2130706433", "192.168.1.1", "100.64.0.1", "0.0.0.0")
PNG = png_bytes(seed=3, size=(32, 32))


def _tiff() -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (8, 8)).save(buf, "TIFF")
    return buf.getvalue()


TIFF = _tiff()  # a valid image in a format the server does not accept
OK_IMAGE = data_uri(PNG)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ---- a local HTTP server for the URL cases ----
class ImageHost(http.server.BaseHTTPRequestHandler):
    # per /slow.png request: bytes written before the fetcher hung up
    slow_bytes_sent: queue.Queue = queue.Queue()

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - the http.server API
        if self.path == "/ok.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        # drips a byte every 0.2 s for up to 10 s: a timeout must cut it off
        elif self.path == "/slow.png":
            self.send_response(200)
            self.send_header("Content-Length", "50")
            self.end_headers()
            sent = 0
            try:
                for _ in range(50):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    sent += 1
                    time.sleep(0.2)
            except OSError:  # the fetcher hung up: stop
                pass
            self.slow_bytes_sent.put(sent)
        elif self.path == "/huge-declared.png":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
        elif self.path == "/huge-undeclared.png":  # no Content-Length, more than the cap
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 8192)
            except OSError:
                pass
        elif self.path == "/redirect-out":
            self._send(302, b"", {"Location": "http://not-allowlisted.example/x.png"})
        elif self.path == "/redirect-ok":
            self._send(302, b"", {"Location": "/ok.png"})
        elif self.path == "/redirect-loop":
            self._send(302, b"", {"Location": "/redirect-loop"})
        elif self.path == "/redirect-file":
            self._send(302, b"", {"Location": "file:///etc/passwd"})
        else:
            self._send(404, b"no", {})

    def _send(self, status, body, headers):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def local_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    (root / "ok.png").write_bytes(PNG)
    (root / "sub").mkdir()
    os.symlink("/etc/passwd", root / "escape.png")  # inside the root, pointing out of it
    os.mkfifo(root / "fifo.png")  # opening a FIFO would wait for a writer
    (root / "big.png").write_bytes(b"\0" * (MAX_IMAGE + 1))
    return root


@pytest.fixture(scope="module")
def servers(local_root, image_host):
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    names = (MODEL,)
    main = build_app(loop, ServeConfig(names, max_body_bytes=MAX_BODY, images=ImagePolicy(
        max_image_bytes=MAX_IMAGE, allowed_url_hosts=PRIVATE_HOSTS + ("public.example",),
        allowed_local_root=str(local_root))))
    default = build_app(loop, ServeConfig(names))
    private = build_app(
        loop,
        ServeConfig(
            names, images=ImagePolicy(max_image_bytes=MAX_IMAGE, allowed_url_hosts=("127.0.0.1", ),
                                      allow_private_urls=True, url_timeout=1.0)))
    try:
        with ServerThread(main) as main_url, ServerThread(default) as default_url, \
                ServerThread(private) as private_url:
            yield SimpleNamespace(main=httpx.Client(base_url=main_url, timeout=60),
                                  default=httpx.Client(base_url=default_url, timeout=60),
                                  private=httpx.Client(base_url=private_url, timeout=60),
                                  engine=engine, root=local_root, host=image_host)
    finally:
        loop.close()


def assert_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    for fragment in fragments:
        assert fragment.lower() in error["message"].lower(
        ), f"{fragment!r} not in {error['message']!r}"
    return error


def assert_still_serving(client: httpx.Client) -> None:
    r = client.post(CHAT, json=chat_body("Say hi.", [OK_IMAGE], max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


# ---- the table ----
@dataclass
class Case:
    id: str
    status: int
    fragments: tuple
    json: dict | list | None = None
    content: bytes | None = None
    path: str = CHAT
    method: str = "POST"
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})


def image(url: str, **extra) -> dict:
    return chat_body("What is this?", [url], **extra)


def user(text="hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


HOSTILE_CASES = [
    # -- framing --
    Case("malformed-json", 400, ("not valid JSON", ), content=b'{"messages": [}'),
    Case("empty-body", 400, ("not valid JSON", ), content=b""),
    Case("json-array-body", 400, ("must be a JSON object", ), json=[1, 2]),
    Case("not-utf8", 400, ("not valid UTF-8", ), content=b'{"messages": "\xff\xfe"}'),
    Case("deeply-nested-json", 400, ("nested too deeply", ),
         content=b"[" * 100_000 + b"]" * 100_000),
    Case("wrong-content-type", 415, ("application/json", ), content=json.dumps(user()).encode(),
         headers={"content-type": "text/plain"}),
    Case("form-content-type", 415, ("application/json", ), content=b"messages=hi",
         headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("unknown-route", 404, ("no route", ), path="/v1/secret", json=user()),
    Case("wrong-method", 405, ("not allowed", ), method="GET", json=None),
    # -- shape and types --
    Case("messages-missing", 400, ("messages", "field required"), json={"max_tokens": 4}),
    Case("messages-not-a-list", 400, ("messages", "valid list"), json={"messages": "hello"}),
    Case("messages-empty", 400, ("messages", "at least 1"), json={"messages": []}),
    Case("message-without-role", 400, ("role", "field required"),
         json={"messages": [{"content": "hi"}]}),
    Case("unknown-role", 400, ("role", ), json={"messages": [{"role": "wizard", "content": "hi"}]}),
    Case("content-a-number", 400, ("content", ),
         json={"messages": [{"role": "user", "content": 5}]}),
    Case(
        "unknown-part-type", 400, ("input_audio", ), json={
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
        }),
    Case("image-part-without-url", 400, ("url", "field required"),
         json={"messages": [{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {}}]}]}),
    Case("temperature-string", 400, ("temperature", "valid number"), json=user(temperature="0.5")),
    Case("temperature-negative", 400, ("temperature", "greater than or equal to 0"),
         json=user(temperature=-1)),
    Case("temperature-too-high", 400, ("temperature", "less than or equal to 2"),
         json=user(temperature=3)),
    Case("temperature-nan", 400, ("temperature", ),
         content=b'{"messages":[{"role":"user","content":"hi"}],'
         b'"temperature":NaN}'),
    Case("top-p-zero", 400, ("top_p", "(0, 1]"), json=user(top_p=0)),
    Case("top-p-infinite", 400, ("top_p", "finite"),
         content=b'{"messages":[{"role":"user","content":"hi"}],'
         b'"top_p":1e999}'),
    Case("top-k-negative", 400, ("top_k", ), json=user(top_k=-5)),
    Case("max-tokens-negative", 400, ("max_tokens", "greater than or equal to 1"),
         json=user(max_tokens=-1)),
    Case("max-tokens-zero", 400, ("max_tokens", ), json=user(max_tokens=0)),
    Case("max-tokens-float", 400, ("max_tokens", "valid integer"), json=user(max_tokens=1.5)),
    Case("max-tokens-bool", 400, ("max_tokens", "valid integer"), json=user(max_tokens=True)),
    Case("max-tokens-huge", 400, ("maximum context length", ), json=user(max_tokens=10**30)),
    Case("stream-not-bool", 400, ("stream", ), json=user(stream="yes")),
    Case("n-zero", 400, ("n", "greater than or equal to 1"), json=user(n=0)),
    Case("n-huge", 400, ("limit is 16", ), json=user(n=1000)),
    Case("top-logprobs-100", 400, ("top_logprobs", "less than or equal to 20"),
         json=user(logprobs=True, top_logprobs=100)),
    Case("completion-logprobs-100", 400, ("logprobs", "less than or equal to 20"), path=COMPLETIONS,
         json={"prompt": "hi", "logprobs": 100}),
    Case("seed-too-big", 400, ("seed", ), json=user(seed=2**70)),
    Case("seed-negative", 400, ("seed", ), json=user(seed=-1)),
    Case("stop-empty-string", 400, ("stop", "non-empty"), json=user(stop=[""])),
    Case("stop-too-many", 400, ("stop", "limit is 16"),
         json=user(stop=[f"s{i}" for i in range(100)])),
    Case("presence-penalty-out-of-range", 400, ("presence_penalty", ),
         json=user(presence_penalty=5)),
    Case("tool-without-function", 400, ("tools.0.function", "required"),
         json=user(tools=[{"type": "function"}])),
    Case("response-format-unknown-type", 400, ("response_format", ),
         json=user(response_format={"type": "yaml"})),
    Case("unknown-model", 404, ("does not exist", ), json=user(model="gpt-4o")),
    Case("unknown-model-completions", 404, ("does not exist", ), path=COMPLETIONS,
         json={"model": "../../etc/passwd", "prompt": "hi"}),
    Case("mm-kwargs-unknown-key", 400, ("mm_processor_kwargs", ),
         json=user(mm_processor_kwargs={"foo": 1})),
    Case("mm-kwargs-negative", 400, ("mm_processor_kwargs", ),
         json=user(mm_processor_kwargs={"max_pixels": -5})),
    # -- prompts --
    Case("prompt-over-context", 400, ("max_model_len", ), json=user("hello " * 3000)),
    Case("vision-tokens-in-chat-text", 400, ("special vision token", ),
         json=user("look: <|vision_start|><|image_pad|><|vision_end|>")),
    Case("vision-tokens-in-completion", 400, ("special vision token", ), path=COMPLETIONS,
         json={"prompt": "<|image_pad|> describe"}),
    Case("vision-token-ids-in-completion", 400, ("vision token ids", ), path=COMPLETIONS,
         json={"prompt": [151652, 151655, 151653]}),
    Case("token-id-out-of-vocab", 400, ("vocabulary", ), path=COMPLETIONS,
         json={"prompt": [10**9]}),
    Case("empty-prompt", 400, ("empty", ), path=COMPLETIONS, json={"prompt": ""}),
    Case("echo-unsupported", 400, ("echo", ), path=COMPLETIONS, json={"prompt": "hi",
                                                                      "echo": True}),
    # -- images, inline --
    Case("image-bomb", 400, ("pixels", "decompression bomb"),
         json=image(data_uri(png_bomb(100_000, 100_000)))),
    Case(
        "svg-as-png", 400, ("not a PNG / JPEG", ), json=image(
            data_uri(
                b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" '
                b'height="10"/></svg>'
            ))),
    Case("text-as-png", 400, ("not a PNG / JPEG", ), json=image(data_uri(b"hello, not a picture"))),
    Case("truncated-png", 400, ("truncated", ), json=image(data_uri(PNG[:len(PNG) // 2]))),
    Case(
        "eps-for-ghostscript", 400, ("not a PNG / JPEG", ), json=image(
            data_uri(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n(%pipe%id) (w) file\n"))),
    Case("tiff-not-accepted", 400, ("not a PNG / JPEG", ), json=image(data_uri(TIFF,
                                                                               "image/tiff"))),
    Case("bomb-under-pil-limit", 400, ("pixels", "over the limit"),
         json=image(data_uri(png_bomb(9000, 9000)))),
    Case("empty-image", 400, ("no data", ), json=image("data:image/png;base64,")),
    Case("invalid-base64", 400, ("not valid base64", ),
         json=image("data:image/png;base64,!!!notbase64!!!")),
    Case("non-image-data-uri", 400, ("not an image", ),
         json=image("data:text/plain;base64,aGVsbG8=")),
    Case("non-base64-data-uri", 400, ("only base64", ), json=image("data:image/png,rawbytes")),
    Case("image-over-byte-limit", 400, ("larger than the limit", ),
         json=image(data_uri(b"\0" * (MAX_IMAGE + 10)))),
    Case("too-many-images", 400, ("1000 images", "limit is 16"),
         json=chat_body("hi", [data_uri(png_bytes(size=(1, 1)))] * 1000)),
    # -- image sources --
    Case("bare-path", 400, ("unsupported image URL", ), json=image("/etc/passwd")),
    Case("relative-path", 400, ("unsupported image URL", ), json=image("cat.png")),
    Case("ftp-url", 400, ("unsupported image URL", ), json=image("ftp://public.example/a.png")),
    Case("javascript-url", 400, ("unsupported image URL", ), json=image("javascript:alert(1)")),
    *[
        Case(f"private-url-{host}", 400, ("non-public address", ),
             json=image(f"http://{'[' + host + ']' if ':' in host else host}/latest/meta-data"))
        for host in PRIVATE_HOSTS
    ],
    Case("private-url-with-port", 400, ("non-public address", ),
         json=image("http://127.0.0.1:8000/v1/models")),
    Case("host-not-allowlisted", 400, ("not in this server's allowlist", ),
         json=image("http://evil.example/a.png")),
    Case("userinfo-trick", 400, ("not in this server's allowlist", ),
         json=image("http://public.example@evil.example/a.png")),
    Case("file-etc-passwd", 400, ("outside the folder", ), json=image("file:///etc/passwd")),
    Case("file-with-host", 400, ("must be absolute", ), json=image("file://etc/passwd")),
]


def _file_cases(root) -> list[Case]:
    return [
        Case("file-dotdot-traversal", 400, ("outside the folder", ),
             json=image(f"file://{root}/../../../etc/passwd")),
        Case("file-encoded-traversal", 400, ("outside the folder", ),
             json=image(f"file://{root}/sub/%2e%2e/%2e%2e/%2e%2e/etc/passwd")),
        Case("file-symlink-escape", 400, ("outside the folder", ),
             json=image(f"file://{root}/escape.png")),
        Case("file-fifo", 400, ("not a regular file", ), json=image(f"file://{root}/fifo.png")),
        Case("file-directory", 400, ("not a regular file", ), json=image(f"file://{root}/sub")),
        Case("file-too-big", 400, ("larger than the limit", ),
             json=image(f"file://{root}/big.png")),
        Case("file-missing", 400, ("not found", ), json=image(f"file://{root}/nope.png")),
        Case("file-nul-byte", 400, ("NUL", ), json=image(f"file://{root}/ok.png%00.txt")),
    ]


NUM_FILE_CASES = 8


def _send(client: httpx.Client, case: Case) -> httpx.Response:
    if case.method == "GET":
        return client.get(case.path)
    if case.content is not None:
        return client.post(case.path, content=case.content, headers=case.headers)
    return client.post(case.path, content=json.dumps(case.json).encode(), headers=case.headers)


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[c.id for c in HOSTILE_CASES])
def test_hostile_request(servers, case):
    assert_error(_send(servers.main, case), case.status, *case.fragments)
    assert_still_serving(servers.main)


@pytest.mark.parametrize("index", range(NUM_FILE_CASES))
def test_hostile_file_url(servers, index):
    case = _file_cases(servers.root)[index]
    assert_error(_send(servers.main, case), case.status, *case.fragments)
    assert_still_serving(servers.main)


# ---- cases that need more than a table row ----
HOSTILE_TESTS = []


def hostile(fn):
    HOSTILE_TESTS.append(fn.__name__)
    return fn


@hostile
def test_body_over_the_limit(servers):
    big = json.dumps(user("x" * (MAX_BODY + 10))).encode()
    assert_error(servers.main.post(CHAT, content=big, headers={"content-type": "application/json"}),
                 413, "larger than the limit")
    assert_still_serving(servers.main)


@hostile
def test_chunked_body_over_the_limit(servers):
    def chunks():  # no Content-Length: the cap must hold while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * (128 << 10)
        yield b'"}]}'

    assert_error(
        servers.main.post(CHAT, content=chunks(), headers={"content-type": "application/json"}),
        413, "larger than the limit")
    assert_still_serving(servers.main)


@hostile
def test_image_urls_off_by_default(servers):
    assert_error(servers.default.post(CHAT, json=image(f"{servers.host}/ok.png")), 400,
                 "image URLs are disabled")
    assert_error(servers.default.post(CHAT, json=image(f"file://{servers.root}/ok.png")), 400,
                 "file:// image URLs are disabled")
    assert_still_serving(servers.default)


@hostile
def test_slow_url_times_out(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/slow.png")), 400,
                 "longer than 1s")
    # The fetch was cut off: the host saw the server hang up before its 10 s drip was over. The
    # host's count is the evidence, not a clock bound, which a loaded machine could break.
    sent = ImageHost.slow_bytes_sent.get(timeout=30)
    assert sent < 50, f"the server read the whole slow body ({sent} bytes) instead of timing out"
    assert_still_serving(servers.private)


@hostile
def test_url_with_huge_declared_length(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/huge-declared.png")), 400,
                 "over the limit")


@hostile
def test_url_with_huge_undeclared_body(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/huge-undeclared.png")), 400,
                 "exceeds the limit")


@hostile
def test_url_redirect_out_of_the_allowlist(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/redirect-out")), 400,
                 "not-allowlisted.example", "allowlist")


@hostile
def test_url_redirect_to_file(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/redirect-file")), 400,
                 "scheme 'file'")


@hostile
def test_url_redirect_loop(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/redirect-loop")), 400,
                 "redirected more than 3 times")


@hostile
def test_url_not_found(servers):
    assert_error(servers.private.post(CHAT, json=image(f"{servers.host}/missing.png")), 400,
                 "HTTP 404")
    assert_still_serving(servers.private)


def test_allowed_sources_work(servers):
    """The controls: what the policy allows does go through."""
    for client, url in ((servers.private, f"{servers.host}/ok.png"),
                        (servers.private, f"{servers.host}/redirect-ok"),
                        (servers.main, f"file://{servers.root}/ok.png"), (servers.main, OK_IMAGE)):
        r = client.post(CHAT, json=image(url, max_tokens=2))
        assert r.status_code == 200, (url, r.text)


def test_engine_is_clean_after_the_barrage(servers):
    bm = servers.engine.block_manager
    deadline = time.monotonic() + 5
    while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bm.num_free_blocks == bm.num_blocks and not servers.engine.requests
    assert len(servers.engine.model_runner.encoder_cache) == 0


def test_count_of_hostile_cases():
    """The README's count, exactly: a case added or dropped changes both. Each case is its own test,
    and no test here can be skipped (its dependencies are imported, tests/conftest.py fails a run
    that lacks one)."""
    total = len(HOSTILE_CASES) + NUM_FILE_CASES + len(HOSTILE_TESTS)
    print(
        f"\n{total} hostile cases ({len(HOSTILE_CASES)} in the table, {NUM_FILE_CASES} file URLs, "
        f"{len(HOSTILE_TESTS)} separate tests)")
    ids = [c.id for c in HOSTILE_CASES] + [c.id for c in _file_cases("/root")] + HOSTILE_TESTS
    assert len(set(ids)) == len(ids) == total
    with open(os.path.join(REPO, "README.md")) as f:
        promised = re.search(r"\*\*(\d+) hostile-input cases\*\*", f.read())
    assert promised, "the README no longer states the count of hostile-input cases"
    assert total == int(promised.group(1)) == 102


@pytest.mark.parametrize("part", ["image_url", "video_url"])
def test_a_url_given_as_a_string_is_said_plainly(part):
    """{"type": "image_url", "image_url": "https://..."}: one 400 line showing OpenAI's object
    shape, not pydantic's union noise (fails today: "Input should be a valid dictionary ...;
    messages.0.content: Input should be a valid string")."""
    from vlinfer.serve.body import parse_body
    from vlinfer.serve.errors import ApiError
    from vlinfer.serve.protocol import ChatCompletionRequest
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": part, part: "https://example.com/cat.png"}, {"type": "text", "text": "hi"}]}]}
    with pytest.raises(ApiError) as e:
        parse_body(ChatCompletionRequest, json.dumps(body).encode())
    message = str(e.value)
    assert f'{part} must be an object {{"url": ...}}' in message
    assert f'"{part}": {{"url": "https://example.com/cat.png"}}' in message
    assert "valid string" not in message
