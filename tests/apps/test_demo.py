"""The Gradio demo (apps/demo.py) end to end: a real server subprocess on the embedded tiny model,
driven through gradio_client the way a browser tab drives it; in headless Chromium (DevTools
protocol, tests/support/browser.py), the rendered DOM's chat widgets and a question typed and
submitted with a click, answered with the model's own tokens (a demo whose chat shows no answer, a
planted bug, fails that check); and one screenshot of the page."""
import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from browser import Page

import gradio  # noqa: F401  (the demo's own dependency: a test dependency, imported, never skipped)
import pytest
from gradio_client import Client
from demo_cases import (DEMO, NOTICE_TITLE, ROOT, _answer, _as_input, _chat, _client, _start,
                        _stop, _texts, _wait_serving, _watch)

SCREENSHOT = ROOT / "apps" / "screenshot.sh"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, port, log path) of a demo server on qwen3-vl-tiny; always stopped, whatever the tests
    do."""
    log_path = tmp_path_factory.mktemp("demo") / "server.log"
    proc, port = _start(log_path, "--model", "qwen3-vl-tiny", "--max-model-len", "4096",
                        "--concurrency", "8")
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_serving(proc, url, log_path)
        yield url, port, log_path
    finally:
        _stop(proc)


def _image(path: Path, color=(200, 40, 40), size=(64, 48)) -> str:
    from PIL import Image
    Image.new("RGB", size, color).save(path)
    return str(path)


def _active(client: Client) -> int:
    match = re.search(r"\*\*(\d+)\*\*", client.predict(api_name="/engine_status"))
    assert match, "engine_status did not report a count"
    return int(match.group(1))


# ---- pure helpers (no server) ----
def _demo_module():
    spec = importlib.util.spec_from_file_location("vlinfer_demo_app", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_history_becomes_openai_messages():
    demo = _demo_module()
    history = [
        {
            "role": "user", "content": [{"type": "file", "file": {"path": "/a.png"}},
                                        {"type": "text", "text": "hi"}]
        },
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {
            "role": "user", "content": [{"type": "file", "file": {"path": "/bad.png"}},
                                        {"type": "text", "text": "?"}]
        },
        {
            "role": "assistant", "content": [{"type": "text", "text": "rejected"}],
            "metadata": {"title": demo.NOTICE_TITLE}
        },
        {"role": "user", "content": [{"path": "/b.png"}, {"path": "/c.png"}, "both?"]},
    ]
    assert demo.model_messages(history) == [
        {
            "role": "user", "content": [{"type": "image", "image": "/a.png"},
                                        {"type": "text", "text": "hi"}]
        },
        {"role": "assistant", "content": "hello"},
        # the rejected turn and its notice are gone
        {
            "role": "user", "content": [{"type": "image",
                                         "image": "/b.png"}, {"type": "image", "image": "/c.png"},
                                        {"type": "text", "text": "both?"}]
        },
    ]
    assert demo.read_input({"text": "  q ", "files": [{"path": "/x.png"},
                                                      "/y.png"]}) == ("q", ["/x.png", "/y.png"])
    assert demo.example_images(ROOT / "no-such-folder") == []


# ---- the running server ----
def test_image_question_streams_an_answer_and_keeps_history(server, tmp_path):
    url, _, log_path = server
    client = _client(url)
    job = _chat(client, "What color is this image?", [_image(tmp_path / "red.png")], max_tokens=24)
    seen = _watch(job)
    history = job.result(timeout=60)[0]
    assert history[0]["role"] == "user" and any(
        p.get("type") == "file" for p in history[0]["content"])
    final = _answer(history)
    assert final and seen[-1] == final
    grown = [t for t in seen if t]
    assert len(grown) >= 3, f"the answer did not stream: {len(grown)} distinct partial answers"
    bad = [(a, b) for a, b in zip(grown, grown[1:]) if not b.startswith(a)]
    assert not bad, f"partial answers must only grow: {bad[:3]}"

    # A second turn with two more images: the history (with its image) goes back to the model.
    images = [
        _image(tmp_path / "green.png", (30, 200, 30)),
        _image(tmp_path / "blue.png", (30, 30, 200), (48, 64))
    ]
    job = _chat(client, "And these two?", images, history=_as_input(history), max_tokens=8)
    history2 = job.result(timeout=60)[0]
    assert [m["role"] for m in history2] == ["user", "assistant", "user", "assistant"]
    assert sum(p.get("type") == "file" for p in history2[2]["content"]) == 2
    assert _answer(history2) and not (history2[-1].get("metadata") or {}).get("title")
    # the model got all three turns' messages with all three images (the demo logs each request)
    assert re.search(r"request \S+: 3 messages, 3 images, max_tokens=8", log_path.read_text()), \
        log_path.read_text()[-2000:]


def test_two_sessions_are_batched_together(server, tmp_path):
    url, _, _ = server
    image = _image(tmp_path / "img.png")
    clients = [_client(url) for _ in range(2)]
    observer = _client(url)
    spans, answers, most_active = {}, {}, [0]
    stop = threading.Event()

    def observe():  # how many requests the engine holds at once
        while not stop.is_set():
            most_active[0] = max(most_active[0], _active(observer))
            time.sleep(0.1)

    def session(i):
        start = time.monotonic()
        # Long enough that the first is still generating when the second arrives, even on a loaded
        # machine.
        history = _chat(clients[i], f"Session {i}: describe it.", [image],
                        max_tokens=200).result(timeout=90)[0]
        spans[i] = (start, time.monotonic())
        answers[i] = _answer(history)

    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    watcher.join(timeout=10)
    assert sorted(answers) == [0, 1] and all(
        answers.values()), f"a session got no answer: {answers}"
    (s0, e0), (s1, e1) = spans[0], spans[1]
    assert max(s0, s1) < min(e0, e1), "the two sessions did not overlap in time"
    assert most_active[0] >= 2, "the engine never held both requests at once: they were not batched"


def test_broken_image_gets_a_clear_message_and_server_keeps_serving(server, tmp_path):
    url, _, log_path = server
    client = _client(url)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"this is not a png at all")
    log_start = log_path.stat().st_size
    history = _chat(client, "What is this?", [str(broken)]).result(timeout=60)[0]
    last = history[-1]
    assert last["role"] == "assistant" and (last.get("metadata") or {}).get("title") == NOTICE_TITLE
    text = _texts(last)
    assert "rejected" in text and "cannot identify image format" in text, text
    assert "Traceback" not in text

    # The next turn carries the rejected one in its history; the demo leaves it out of the model's
    # prompt.
    job = _chat(client, "Then just say something.", [], history=_as_input(history), max_tokens=8)
    history2 = job.result(timeout=60)[0]
    assert _answer(history2) and not (history2[-1].get("metadata") or {}).get("title"), history2[-1]
    # and a fresh session is still served
    assert _answer(_chat(_client(url), "Hello?", [], max_tokens=8).result(timeout=60)[0])
    with open(log_path, "rb") as f:
        f.seek(log_start)
        assert b"Traceback" not in f.read(), "the server logged a traceback for a bad image"


def test_stop_aborts_the_request_in_the_engine(server, tmp_path):
    url, _, log_path = server
    client, observer = _client(url), _client(url)
    job = _chat(client, "Talk for a long time.", [_image(tmp_path / "red.png")], max_tokens=4000)
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3:
        assert not job.done() and time.monotonic(
        ) < deadline, "the long request did not start streaming"
        time.sleep(0.05)
    assert _active(observer) == 1
    request_id = re.findall(r"request (\S+): \d+ messages, \d+ images, max_tokens=4000",
                            log_path.read_text())[-1]
    job.cancel()  # what the Stop button does: Gradio cancels the event and closes the generator
    # The demo logs the abort of an unfinished answer (one that ended by itself would not say so):
    # the event, not how fast the engine emptied, shows that Stop freed it. The deadline only bounds
    # a wait.
    stopped = f"request {request_id}: stopped before it finished, aborted in the engine"
    deadline = time.monotonic() + 60
    while stopped not in log_path.read_text() or _active(observer):
        assert time.monotonic() < deadline, "the stopped request was not aborted in the engine"
        time.sleep(0.2)
    assert _answer(_chat(client, "Still there?", [], max_tokens=4).result(timeout=60)[0])


def test_example_gallery_lists_the_example_images(server):
    url, _, _ = server
    folder = ROOT / "examples" / "images"
    suffixes = _demo_module().IMAGE_SUFFIXES
    expected = sorted(p.name for p in folder.iterdir()
                      if p.suffix.lower() in suffixes) if folder.is_dir() else []
    galleries = [c for c in _client(url).config["components"] if c.get("type") == "gallery"]
    # else this test would check nothing
    assert expected, "examples/images ships the example pictures"
    assert len(galleries) == 1
    shown = sorted(Path(item["image"]["path"]).name for item in galleries[0]["props"]["value"])
    assert shown == expected


# A demo whose chat callback never shows an answer (the user's turn only): the planted bug the
# browser test must catch.
SILENT_DEMO = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("demo", {demo!r})
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
demo.answer_messages = lambda reasoning, answer: []
sys.exit(demo.main())
"""
QUESTION, ANSWER_TOKENS = "Say hi", 12


def _greedy_answer(url: str) -> str:
    """What the model answers QUESTION (greedy, ANSWER_TOKENS), through the API."""
    history, _ = _client(url).predict({"text": QUESTION, "files": []}, [], 0.0, 0.9,
                                      ANSWER_TOKENS, api_name="/chat")
    return _answer(history)


def _set_number(page: Page, label: str, value) -> None:
    """Types a value into the number box of the slider labelled `label`, as a user does."""
    selector = f"#number-{label.lower().replace(' ', '-')}"
    page.evaluate(f"""(() => {{
        const box = [...document.querySelectorAll('[data-testid=number-input]')]
            .find(e => e.closest('.block').innerText.includes({label!r}));
        box.id = {selector[1:]!r}; box.select(); }})()""")
    page.type(selector, str(value))
    page.evaluate(f"document.querySelector({selector!r}).blur()")
    assert page.evaluate(f"document.querySelector({selector!r}).value") == str(value)


def _ask_in_the_browser(url: str, expected: str, answer_timeout: float) -> None:
    """The rendered page (DOM) has the chat, the message box, the image input and the submit
    button; with temperature 0 and ANSWER_TOKENS set in their boxes, QUESTION typed and submitted
    with a click shows the user's turn and then `expected` as the bot's message."""
    page = Page(url)
    try:
        page.wait_for("document.readyState === 'complete' && "
                      "document.querySelector('textarea[data-testid=textbox]') !== null", 60,
                      "the page rendering its message box")
        dom = page.dom()
        assert re.search(r'<div id="chat"', dom) and 'aria-label="chatbot conversation"' in dom
        box = re.search(r'<textarea[^>]*data-testid="textbox"[^>]*>', dom)
        assert box and "Ask about images or videos" in box.group(0), "no message box"
        files = re.search(r'<input[^>]*type="file"[^>]*>', dom)
        assert files and 'accept="image/*' in files.group(0), "no image input"
        submit = re.search(r'<button[^>]*data-testid="submit-button"[^>]*>', dom)
        assert submit and 'aria-label="Submit"' in submit.group(0), "no submit button"
        _set_number(page, "Temperature", 0)
        _set_number(page, "Max new tokens", ANSWER_TOKENS)
        box = "document.querySelector('textarea[data-testid=textbox]')"
        page.type("textarea[data-testid=textbox]", QUESTION)
        page.wait_for(f"{box}.value === {QUESTION!r}", 10, "the typed question in the box")
        turn = ("[...document.querySelectorAll('#chat [data-testid=user]')]"
                f".some(e => e.innerText.trim() === {QUESTION!r})")
        # A click the busy page dropped leaves the question in the box (a submit empties it): only
        # then is it clicked again, so the question is never sent twice.
        for _ in range(3):
            page.click("button.submit-button")
            try:
                page.wait_for(f"{turn} || {box}.value === ''", 20, "the question leaving the box")
                break
            except AssertionError:
                continue
        page.wait_for(turn, 30, "the user's turn")
        shown = f"bot's message: {expected}"
        page.wait_for(f"[...document.querySelectorAll('#chat [data-testid=bot]')]"
                      f".some(e => e.getAttribute('aria-label') === {shown!r})", answer_timeout,
                      "the model's answer showing in the chat")
    finally:
        page.close()


def test_a_question_typed_and_clicked_in_the_browser_gets_the_models_answer(server):
    """Chromium renders the page, a user types and clicks Submit, and the chat shows exactly what
    the model answers through the API (the embedded toy's greedy tokens), logged as a request."""
    url, _, log_path = server
    expected = _greedy_answer(url)
    assert expected
    requests = log_path.read_text().count(f"max_tokens={ANSWER_TOKENS}")
    _ask_in_the_browser(url, expected, answer_timeout=60)
    assert log_path.read_text().count(f"max_tokens={ANSWER_TOKENS}") == requests + 1


@pytest.mark.slow  # a second demo subprocess
def test_the_browser_check_fails_on_a_demo_that_shows_no_answer(server, tmp_path):
    """The control: a demo whose chat callback shows the user's turn and never an answer (a
    planted bug) fails the browser check, though its page renders every widget."""
    url, _, _ = server
    expected = _greedy_answer(url)
    script = tmp_path / "silent_demo.py"
    script.write_text(SILENT_DEMO.format(demo=str(DEMO)))
    log_path = tmp_path / "silent.log"
    proc, port = _start(log_path, "--model", "qwen3-vl-tiny", "--max-model-len", "4096",
                        script=script)
    try:
        silent = f"http://127.0.0.1:{port}/"
        _wait_serving(proc, silent, log_path)
        with pytest.raises(AssertionError, match="the model's answer showing in the chat"):
            _ask_in_the_browser(silent, expected, answer_timeout=15)
    finally:
        _stop(proc)


def test_screenshot(server, tmp_path):
    """One headless Chromium screenshot of the page. DEMO_SCREENSHOT=docs/demo.png refreshes the
    committed one."""
    # A test dependency like the pip ones: missing, it fails the run rather than shrinking it.
    assert shutil.which("chromium"), ("the browser is missing: install Debian's chromium "
                                      "(apt-get install -y chromium) to take the demo screenshot")
    _, port, _ = server
    out = Path(os.environ.get("DEMO_SCREENSHOT") or tmp_path / "demo.png")
    if not out.is_absolute():
        out = ROOT / out
    subprocess.run(["bash", str(SCREENSHOT), str(port), str(out)], cwd=ROOT, check=True, timeout=90,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    with Image.open(out) as img:
        assert img.size == (1280, 900)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    # A blank or error page has a handful of colours; the rendered app (text, sliders, buttons) has
    # hundreds.
    assert colors is not None and len(
        colors) > 50, f"the screenshot looks blank ({len(colors or [])} colours)"


@pytest.mark.slow  # a demo subprocess
def test_default_context_length_follows_the_model(tiny_vl_with_context, tmp_path):
    """No --max-model-len: a 2048-position model serves at 2048 (a fixed 8192 default used to refuse
    to start); a 262144-position one (as Qwen3-VL declares) at 8192, fitted down to a small KV
    cache, with a warning."""
    runs = {2048: ((), 2048), 262144: (("--kv-cache-size", "3M"), 3072)}
    demos = {}
    try:
        for positions, (extra, _) in runs.items():  # both at once: their startups overlap
            log_path = tmp_path / f"demo-{positions}.log"
            proc, port = _start(log_path, "--model", tiny_vl_with_context(positions),
                                "--concurrency", "2", *extra)
            demos[positions] = (proc, f"http://127.0.0.1:{port}/", log_path)
        for positions, (proc, url, log_path) in demos.items():
            _wait_serving(proc, url, log_path)
            client = _client(url)
            header = " ".join(
                str(c.get("props", {}).get("value")) for c in client.config["components"]
                if c.get("type") == "markdown")
            assert f"**max context:** {runs[positions][1]} tokens" in header, header[:500]
            assert _answer(_chat(client, "Hello?", [], max_tokens=4).result(timeout=60)[0])
        # the demo's flag
        assert "--max-model-len=3072: the KV cache" in demos[262144][2].read_text()
    finally:
        for proc, _, _ in demos.values():
            _stop(proc)
