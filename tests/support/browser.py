"""A headless Chromium page driven through the DevTools protocol over a pipe
(--remote-debugging-pipe: JSON messages ended by a NUL byte on fds 3 and 4), so a test reads the
rendered DOM and clicks as a user does with the standard library alone (no websocket client)."""
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900", "--remote-debugging-pipe"]


class Page:
    """One tab of a headless Chromium on url; close() ends the browser."""

    def __init__(self, url: str, timeout: float = 60):
        chromium = shutil.which("chromium")
        assert chromium, "the browser is missing: install Debian's chromium (make browser)"
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()

        def pipes_at_3_and_4():  # moved above 4 first: either end may be fd 3 or 4 itself
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [chromium, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # kept open: subprocess closes every other fd after preexec_fn
            preexec_fn=pipes_at_3_and_4, pass_fds=(3, 4))
        os.close(to_child)
        os.close(from_child)
        self._buffer, self._next_id, self.timeout = b"", 0, timeout
        target = self.send("Target.createTarget", url=url)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]

    def send(self, method: str, session: str | None = None, **params) -> dict:
        """One command's result (an error reply raises)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                assert time.monotonic() < deadline, f"no answer to {method} from Chromium"
                chunk = os.read(self._in, 1 << 16)
                assert chunk, f"Chromium closed its pipe (exit code {self.proc.poll()})"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:  # events in between are not needed here
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def page(self, method: str, **params) -> dict:
        return self.send(method, self.session, **params)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str):
        """Polls until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError as e:  # the page is still loading: no context to run in yet
                if "context" not in str(e):
                    raise
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f}s"
            time.sleep(0.25)

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the centre of the element."""
        x, y = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Focuses the element and types the text as keyboard input."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.page("Input.insertText", text=text)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except AssertionError:
            pass  # already gone
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._in)
        os.close(self._out)
        shutil.rmtree(self.profile, ignore_errors=True)
