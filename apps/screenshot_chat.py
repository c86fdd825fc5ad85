"""Headless Chromium screenshot of a running demo with a question about a picture or a clip asked in
it: `python apps/screenshot_chat.py FILE [--question "..."] [--port 7860] [--out docs/demo.png]` (an
image or a video).

apps/screenshot.sh shoots the page as it loads; a file in the chat needs the page driven, so this
talks to Chromium over its DevTools protocol (the `websockets` package Gradio already depends on):
load the page, put the file in the message box's file input, type the question, send, wait for the
streamed answer, capture. Needs Debian's `chromium` (apt-get install -y chromium); the flags keep it
offline, as screenshot.sh does."""
import argparse
import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request


async def _drive(ws_url: str, page_url: str, media: str, question: str, wait_s: float) -> bytes:
    import websockets
    async with websockets.connect(ws_url, max_size=1 << 26) as ws:
        ids = iter(range(1, 1 << 30))

        async def call(method, **params):
            my_id = next(ids)
            await ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
            while True:
                reply = json.loads(await ws.recv())
                if reply.get("id") == my_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})

        async def js(expression):
            return (await call("Runtime.evaluate", expression=expression, awaitPromise=True,
                               returnByValue=True)).get("result", {}).get("value")

        async def until(expression, timeout):
            deadline = time.monotonic() + timeout
            while not await js(expression):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {expression}")
                await asyncio.sleep(0.25)

        await call("Page.enable")
        await call("Page.navigate", url=page_url)
        await until(
            "!!document.querySelector('#chat') && !!document.querySelector('input[type=file]')", 60)
        root = (await call("DOM.getDocument", depth=-1, pierce=True))["root"]["nodeId"]
        node = (await call("DOM.querySelector", nodeId=root, selector="input[type=file]"))["nodeId"]
        await call("DOM.setFileInputFiles", nodeId=node, files=[os.path.abspath(media)])
        await asyncio.sleep(2)  # the upload and its thumbnail
        await js("""(() => { const box = document.querySelector('textarea');
                  box.value = %s; box.dispatchEvent(new Event('input', {bubbles: true})); })()""" %
                 json.dumps(question))
        await until("!!document.querySelector('button.submit-button')", 10)
        await js("document.querySelector('button.submit-button').click()")
        # the file shows in the chat (a picture or a video player), then the answer streams in under
        # it
        await until(
            "!!document.querySelector('#chat video, #chat img') && "
            "document.querySelectorAll('#chat .message-row, #chat .message').length >= 2", 120)
        await asyncio.sleep(wait_s)
        shot = await call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("media", help="an image or a video file")
    p.add_argument("--port", type=int, default=7860, help="the running demo's port")
    p.add_argument("--out", default="docs/demo.png")
    p.add_argument("--question", default="Describe this image.")
    p.add_argument("--wait", type=float, default=6.0, help="seconds of streaming before the shot")
    args = p.parse_args(argv)
    browser = shutil.which("chromium")
    if browser is None:
        print("error: chromium is missing (apt-get install -y chromium)", file=sys.stderr)
        return 2
    profile = tempfile.mkdtemp()
    debug_port = 9200 + os.getpid() % 500
    proc = subprocess.Popen([
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1280,900",
        f"--remote-debugging-port={debug_port}", "about:blank"
    ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{debug_port}/json", timeout=2) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromium's DevTools endpoint did not come up")
            time.sleep(0.3)
        png = asyncio.run(
            _drive(pages[0]["webSocketDebuggerUrl"], f"http://127.0.0.1:{args.port}/", args.media,
                   args.question, args.wait))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "wb") as f:
            f.write(png)
        print(f"wrote {args.out} ({len(png)} bytes)")
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
