"""browser_ui.py -- the chat page at / in headless Chromium (Debian's `chromium`).

Usage: python tests/browser_ui.py K3_BINARY [SCREENSHOT_DIR]
Drives Chromium over its DevTools pipe (--remote-debugging-pipe: no driver, no extra package) against
`k3 serve` on tests/models/tiny and tests/models/vision-tiny: the page loads and names the model; a message
sent streams its reply into the DOM (seen growing), equal to the same request through the API; Stop cancels
a long reply (the server counts an abort and runs nothing afterwards); on the vision checkpoint an image is
uploaded through the file input and goes into the prompt (the prompt tokens equal the API's with that image); a
page on another origin calls chat, Responses and Messages with CORS allowed (--allowed-origins) and is refused with
it off; --no-ui leaves / a 404.
Screenshots go to SCREENSHOT_DIR (default build/test-browser). Prints `ok   browser: NAME` per check and ends
with `browser: N passed, N failed`.
"""
import base64
import ctypes
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

OUT = sys.argv[2] if len(sys.argv) > 2 else "build/test-browser"


suite = h.Suite("browser")
check = suite.check


class Chromium:
    """Headless Chromium driven over the DevTools protocol on fds 3 (commands in) and 4 (answers out)."""

    def __init__(self):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            raise RuntimeError("chromium not found (sh scripts/install-browser-deps.sh)")
        self.profile = tempfile.mkdtemp(prefix="k3-chromium-")
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()

        def child():
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            os.dup2(cmd_r, 3)
            os.dup2(out_w, 4)
            # dup2 onto the same number keeps close-on-exec (os.pipe's fds have it)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        args = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                "--window-size=1280,860", "--user-data-dir=" + self.profile, "--remote-debugging-pipe",
                "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=child)
        os.close(cmd_r)
        os.close(out_w)
        self.buf = b""
        self.next_id = 0
        self.session = None

    def call(self, method, params=None, session=True, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                m = json.loads(raw)
                if m.get("id") == self.next_id:
                    if "error" in m:
                        raise RuntimeError(f"{method}: {m['error']}")
                    return m.get("result", {})
            chunk = os.read(self.out_r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium went away")
            self.buf += chunk
        raise TimeoutError(method)

    def open(self, url):
        t = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        self.session = self.call("Target.attachToTarget", {"targetId": t["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Page.navigate", {"url": url})
        self.wait("document.readyState === 'complete'")

    def js(self, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr[:80]}: {r['exceptionDetails'].get('text')} "
                               f"{r['exceptionDetails'].get('exception', {}).get('description', '')}")
        return r["result"].get("value")

    def wait(self, expr, timeout=60, what=None):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.js(expr):
                return
            time.sleep(0.05)
        raise TimeoutError(what or expr)

    def screenshot(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.profile, ignore_errors=True)


OTHER_PAGE = b"""<!doctype html><title>another origin</title><script>
async function call(base, path, body, headers) {
  try {
    const r = await fetch(base + path, {method: "POST", body: JSON.stringify(body),
                                        headers: Object.assign({"Content-Type": "application/json"}, headers)});
    return {status: r.status, text: await r.text()};
  } catch (e) { return {error: String(e)}; }
}
</script>"""


class OtherOrigin:
    """A page on another origin (its own port): one static page with a fetch helper."""

    def __init__(self):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(OTHER_PAGE)))
                self.end_headers()
                self.wfile.write(OTHER_PAGE)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def set_value(b, sel, value):
    b.js(f"(() => {{ const e = document.querySelector({json.dumps(sel)}); e.value = {json.dumps(str(value))};"
         f" e.dispatchEvent(new Event('input')); }})()")


LAST = "document.querySelector('.msg.assistant:last-of-type')"
# every length the reply's text has had, as the DOM changed
WATCH = ("window.__lens = []; new MutationObserver(() => { const a = " + LAST + "; if (a) "
         "window.__lens.push(a.querySelector('.content').textContent.length); })"
         ".observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});")


def main():
    b = Chromium()
    s = h.Server(h.TINY)
    c = s.client()
    try:
        def t_load():
            b.open(s.url + "/")
            b.wait(f"document.getElementById('model').textContent.includes({json.dumps(h.TINY)})", 20,
                   "the page names the model")
            assert b.js("document.getElementById('attach').classList.contains('hidden')"), "images on a text model"
            assert b.js("document.getElementById('caps').textContent") == "text"

        def t_stream():
            set_value(b, "#temperature", 0)
            set_value(b, "#max_tokens", 40)
            set_value(b, "#system", "Answer briefly.")
            b.js("document.getElementById('thinking').checked = false")
            b.js(WATCH)
            set_value(b, "#input", "hi")
            b.js("document.getElementById('send').click()")
            b.wait("!document.getElementById('stop').classList.contains('hidden')", 10, "Stop shows while streaming")
            b.wait(LAST + " && " + LAST + ".dataset.finish", 60, "the reply ends")
            text = b.js(LAST + ".querySelector('.content').textContent")
            lens = b.js("window.__lens")
            assert text, "no text in the DOM"
            assert len(set(lens)) >= 3, f"the text did not grow in steps: {lens[:20]}"
            # the same request through the API gives the same words
            r = c.chat.completions.create(model=s.name, messages=[{"role": "system", "content": "Answer briefly."},
                                                                  {"role": "user", "content": "hi"}],
                                          max_tokens=40, temperature=0, top_p=1,
                                          extra_body={"chat_template_kwargs": {"thinking": False}})
            want = r.choices[0].message.content
            if "`" not in want and "**" not in want:
                assert text == want, (text, want)
            stats = b.js(LAST + ".querySelector('.stats').textContent")
            assert "tok/s" in stats and "prompt tokens" in stats, stats
            assert b.js("document.getElementById('send').classList.contains('hidden')") is False
            print("    screenshot: " + b.screenshot(os.path.join(OUT, "chat.png")), flush=True)

        def t_thinking_folded():
            b.js("document.getElementById('thinking').checked = true")
            set_value(b, "#max_tokens", 12)
            set_value(b, "#input", "Think first")
            b.js("document.getElementById('send').click()")
            b.wait(LAST + " && " + LAST + ".dataset.finish", 60, "the reply ends")
            assert b.js(LAST + ".querySelector('details.think').hidden") is False, "no thinking shown"
            assert b.js(LAST + ".querySelector('details.think').open") is False, "the thinking is not folded"
            assert b.js(LAST + ".querySelector('.reasoning').textContent.length") > 0
            # whatever the model wrote and wherever max_tokens cut, no chat markup on the page
            for seed_tokens in (12, 40):
                set_value(b, "#max_tokens", seed_tokens)
                set_value(b, "#input", "Think about the weather and the budget")
                b.js("document.getElementById('send').click()")
                b.wait(LAST + " && " + LAST + ".dataset.finish", 60, "the reply ends")
                page = b.js(LAST + ".textContent")
                assert "<|" not in page and "|>" not in page, page[-200:]
            b.js("document.getElementById('thinking').checked = false")

        def t_stop():
            set_value(b, "#max_tokens", 3000)
            # the tiny model writes 3000 tokens in about 2 s: on a loaded machine the server can be
            # done before the page has shown 20 characters, so Stop counts only while it still runs
            for attempt in range(5):
                m0 = s.metrics()
                ab0 = h.metric(m0, "vllm:request_success_total", finished_reason="abort") or 0
                set_value(b, "#input", "Tell me a long story")
                b.js("document.getElementById('send').click()")
                b.wait(LAST + " && " + LAST + ".querySelector('.content').textContent.length > 20", 30,
                       "text comes")
                if h.metric(s.metrics(), "vllm:num_requests_running") == 1:
                    break
                b.wait(LAST + ".dataset.finish", 30, "the reply ends")
            else:
                raise AssertionError("every reply ended before Stop could be pressed")
            b.js("document.getElementById('stop').click()")
            b.wait(LAST + ".dataset.finish", 10, "the page stops")
            assert b.js(LAST + ".dataset.finish") == "stopped", b.js(LAST + ".dataset.finish")
            n1 = b.js(LAST + ".querySelector('.content').textContent.length")
            h.wait_until(lambda: h.metric(s.metrics(), "vllm:num_requests_running") == 0 and
                         (h.metric(s.metrics(), "vllm:request_success_total", finished_reason="abort") or 0) > ab0,
                         10, "the server to see the request end")
            # the request has ended: nothing more can come to the page
            assert b.js(LAST + ".querySelector('.content').textContent.length") == n1, "text after Stop"
            assert b.js("document.getElementById('stop').classList.contains('hidden')")

        for name, fn in [("the page loads and names the model", t_load),
                         ("a reply streams into the DOM, equal to the API's", t_stream),
                         ("thinking shown folded", t_thinking_folded), ("Stop cancels a long reply", t_stop)]:
            check(name, fn)
    finally:
        s.stop()

    sm = h.Server(h.MINI)
    try:
        def t_mini():
            # the trained demo model: a conversation of two turns, for the screenshot
            b.open(sm.url + "/")
            b.wait(f"document.getElementById('model').textContent.includes({json.dumps(h.MINI)})", 20)
            set_value(b, "#temperature", 0)
            set_value(b, "#max_tokens", 64)
            set_value(b, "#system", "You are a helpful assistant.")
            b.js("document.getElementById('thinking').checked = false")
            for q in ("Who wrote Pride and Prejudice?", "And what is it about?"):
                set_value(b, "#input", q)
                b.js("document.getElementById('send').click()")
                b.wait(LAST + " && " + LAST + ".dataset.finish", 60, "the reply ends")
            assert b.js("document.querySelectorAll('.msg.assistant').length") == 2
            assert b.js(LAST + ".querySelector('.content').textContent.length") > 0
            print("    screenshot: " + b.screenshot(os.path.join(OUT, "chat-k3-mini.png")), flush=True)

        check("k3-mini: a conversation of two turns", t_mini)
    finally:
        sm.stop()

    # a page on another origin (its own little server) calls the API from the browser: allowed
    # with --allowed-origins naming that origin (chat, Responses and Messages, with the headers
    # each SDK sends, so each takes a preflight), refused by default; --no-ui leaves / a 404
    other = OtherOrigin()
    sa = h.Server(h.TINY, "--allowed-origins", other.origin, key="sekret")
    sb = h.Server(h.TINY, "--no-ui")
    try:
        def t_cors():
            b.open(other.origin + "/")
            b.wait("document.title === 'another origin'", 10)
            calls = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                               "stream": True}, {"Authorization": "Bearer sekret"}),
                     ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, {"Authorization": "Bearer sekret"}),
                     ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                      {"x-api-key": "sekret", "anthropic-version": "2023-06-01"})]
            for path, body, hdr in calls:
                got = b.js(f"call({json.dumps(sa.url)}, {json.dumps(path)}, {json.dumps(body)}, {json.dumps(hdr)})")
                assert got.get("status") == 200, (path, got)
                if path.endswith("chat/completions"):
                    assert got["text"].rstrip().endswith("data: [DONE]"), got["text"][-200:]
                else:
                    assert json.loads(got["text"])["usage"]["output_tokens"] == 4, got["text"][:300]
                got = b.js(f"call({json.dumps(sb.url)}, {json.dumps(path)}, {json.dumps(body)}, {json.dumps(hdr)})")
                assert "error" in got and "Failed to fetch" in got["error"], (path, got)
            b.open(sb.url + "/")
            assert "no route GET /" in b.js("document.body.textContent"), b.js("document.body.textContent")

        check("a page on another origin: CORS allowed with --allowed-origins, refused without; --no-ui", t_cors)
    finally:
        sa.stop()
        sb.stop()
        other.close()

    sv = h.Server(h.VISION, "--max-image-pixels", "60000")
    try:
        def t_image():
            b.open(sv.url + "/")
            b.wait("!document.getElementById('attach').classList.contains('hidden')", 20, "the Image button shows")
            path = os.path.abspath(h.IMAGES + "rgb_112x112.png")
            doc = b.call("DOM.getDocument")
            node = b.call("DOM.querySelector", {"nodeId": doc["root"]["nodeId"], "selector": "#file"})["nodeId"]
            b.call("DOM.setFileInputFiles", {"nodeId": node, "files": [path]})
            b.wait("document.querySelectorAll('#pending img').length === 1", 10, "the image is pending")
            set_value(b, "#temperature", 0)
            set_value(b, "#max_tokens", 6)
            b.js("document.getElementById('thinking').checked = false")
            set_value(b, "#input", "What is in the picture?")
            b.js("document.getElementById('send').click()")
            b.wait(LAST + " && " + LAST + ".dataset.finish", 60, "the reply ends")
            assert b.js("document.querySelectorAll('.msg.user .thumbs img').length") == 1
            stats = b.js(LAST + ".querySelector('.stats').textContent")
            got = int(stats.split(" prompt tokens")[0].split()[-1])
            r = sv.client().chat.completions.create(
                model=sv.name, messages=h.image_msg([h.data_url(path)], "What is in the picture?"), max_tokens=6,
                temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
            assert got == r.usage.prompt_tokens and got > 64, (stats, r.usage)
            print("    screenshot: " + b.screenshot(os.path.join(OUT, "chat-image.png")), flush=True)

        check("an image uploaded on the vision checkpoint goes into the prompt", t_image)
    finally:
        sv.stop()
        b.close()


if __name__ == "__main__":
    suite.main(main)
