"""The Gradio demo (apps/demo.py) with videos: a clip uploaded through gradio_client, shown in the
chat and answered with a streamed reply; a follow-up turn that carries the clip in its history; a
broken clip rejected with a clear notice while the demo keeps serving. The server helpers are
tests/apps/test_demo.py's."""
import re

import gradio  # noqa: F401  (the demo's own dependency: a test dependency, imported, never skipped)
import pytest

from videos import drawn_clip, encode
from demo_cases import (NOTICE_TITLE, _answer, _as_input, _chat, _client, _start, _stop, _texts,
                        _wait_serving, _watch)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, log path) of a demo server on qwen3-vl-tiny."""
    log_path = tmp_path_factory.mktemp("demo-video") / "server.log"
    proc, port = _start(log_path, "--model", "qwen3-vl-tiny", "--max-model-len", "4096",
                        "--concurrency", "4")
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_serving(proc, url, log_path)
        yield url, log_path
    finally:
        _stop(proc)


def _file_parts(message: dict) -> list[dict]:
    return [p for p in message["content"] if p.get("type") == "file"]


def test_uploaded_video_is_shown_and_answered_with_a_stream(server, tmp_path):
    url, log_path = server
    clip = tmp_path / "clip.mp4"
    # 3 s: 6 frames at 2 fps, 3 temporal groups
    encode(drawn_clip(12, 64, 96, seed=7), fps=4, path=clip)
    client = _client(url)
    job = _chat(client, "What happens in this clip?", [str(clip)], max_tokens=24)
    seen = _watch(job)
    history = job.result(timeout=90)[0]
    # The chat shows the clip as the user's file (a video: Gradio's mime type from the upload), then
    # the answer.
    (shown,) = _file_parts(history[0])
    assert shown["file"]["path"].endswith(".mp4") and shown["file"].get(
        "mime_type", "video/mp4").startswith("video")
    final = _answer(history)
    assert final and seen[-1] == final
    grown = [t for t in seen if t]
    assert len(grown) >= 3, f"the answer did not stream: {len(grown)} distinct partial answers"
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:])), "partial answers must only grow"
    assert re.search(r"request \S+: 1 messages, 0 images, 1 videos, max_tokens=24",
                     log_path.read_text())

    # A follow-up turn: the clip stays in the history the model sees.
    history2 = _chat(client, "And at the end?", [], history=_as_input(history),
                     max_tokens=6).result(timeout=90)[0]
    assert [m["role"] for m in history2] == ["user", "assistant", "user", "assistant"]
    assert _answer(history2) and not (history2[-1].get("metadata") or {}).get("title")
    assert re.search(r"request \S+: 3 messages, 0 images, 1 videos, max_tokens=6",
                     log_path.read_text())


def test_broken_video_gets_a_clear_message_and_serving_goes_on(server, tmp_path):
    url, log_path = server
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all " * 50)
    client = _client(url)
    history = _chat(client, "What is this?", [str(broken)]).result(timeout=60)[0]
    last = history[-1]
    assert last["role"] == "assistant" and (last.get("metadata") or {}).get("title") == NOTICE_TITLE
    text = _texts(last)
    assert "rejected" in text and "video 0" in text and "not a video" in text, text
    assert _answer(_chat(client, "Then just say something.", [], history=_as_input(history),
                         max_tokens=4).result(timeout=60)[0])
    assert b"Traceback" not in log_path.read_bytes()
