"""The site's diagrams draw in a real browser with no network.

The site is built (``mkdocs build --strict``), served from 127.0.0.1, and every page with a
Mermaid diagram is opened in headless Chromium whose only reachable server is that one:
host names other than 127.0.0.1 do not resolve and every other request goes to a closed
proxy port. A page passes when each of its diagrams became an ``<svg>`` holding the
expected labels, with no Mermaid error drawing and no diagram source left on the page.

mkdocs-material puts each drawing in a *closed* shadow root, which ``--dump-dom`` and page
scripts cannot see, so the browser is driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``; no extra package) and the DOM is read with ``pierce``.
Skipped, saying why, only where no Chromium/Chrome binary or no mkdocs is installed
(.ci/run installs Debian's ``chromium``).
"""

from __future__ import annotations

import base64
import fcntl
import functools
import html
import http.server
import importlib.util
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xavier_async.policy import DEFAULT_STREAK, state_names

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
WAIT_S = 45.0  # a deadline for the page to finish drawing, not a speed assertion

# page -> labels its drawings must contain (every diagram on the page must be drawn)
EXPECTED = {
    "state-machine": [*state_names(DEFAULT_STREAK), "small_batch / small view", "large_batch / full view"],
    "transports": ["rank 1 (NixlTransport)", "rank 0 (NixlTransport)"],
    "concepts": ["caller (rank 1)", "send slab"],
    "failure-model": ["caller task", "receiver (rank 1)"],
    "integration": ["connector worker"],
}


def find_browser() -> str | None:
    explicit = os.environ.get("XAVIER_BROWSER")
    for name in (explicit,) if explicit else BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


# -- a DevTools-protocol client over --remote-debugging-pipe (fd 3: to the browser, fd 4: from it)
class Browser:
    def __init__(self, binary: str, profile: Path, port: int) -> None:
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        # the browser's ends, moved to fds >= 10 so that the redirections below cannot clash
        r, w = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
        os.close(to_r)
        os.close(from_w)
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-quic",
                "--disable-extensions", "--mute-audio", f"--user-data-dir={profile}",
                # no network besides the local server: no host name resolves, and anything
                # else (an IP literal, another loopback port too: <-loopback> drops the
                # implicit loopback bypass) goes to a proxy port where nothing listens
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                "--proxy-server=http://127.0.0.1:9", f"--proxy-bypass-list=<-loopback>;127.0.0.1:{port}",
                "--window-size=1280,2000", "--remote-debugging-pipe", "about:blank"]
        # a tiny exec wrapper puts the pipe ends on fds 3 and 4, where --remote-debugging-pipe
        # wants them (no preexec_fn: this process has threads)
        wire = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); "
                "os.dup2(w, 4); os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])")
        self.proc = subprocess.Popen([sys.executable, "-c", wire, str(r), str(w), *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=(r, w))
        os.close(r)
        os.close(w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> Any:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if not select.select([self._from_r], [], [], WAIT_S)[0]:
                raise RuntimeError(f"no answer from the browser in {WAIT_S:.0f} s")
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"browser exited (rc {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        result: dict[str, Any] = json.loads(raw)
        return result

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_w)
        os.close(self._from_r)

    def open(self, url: str) -> str:
        """A new tab at ``url``; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session: str = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        return session


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for key in ("children", "shadowRoots"):
        for child in node.get(key, []):
            yield from walk(child)
    if "contentDocument" in node:
        yield from walk(node["contentDocument"])


def texts(node: dict[str, Any]) -> str:
    return " ".join(n["nodeValue"] for n in walk(node) if n.get("nodeType") == 3)


def attrs(node: dict[str, Any]) -> dict[str, str]:
    a = node.get("attributes", [])
    return dict(zip(a[::2], a[1::2]))


def diagrams(browser: Browser, session: str) -> tuple[list[dict[str, Any]], str]:
    """(every element with class ``mermaid``, the page's text outside shadow roots)."""
    root = browser.send("DOM.getDocument", {"depth": -1, "pierce": True}, session=session)["root"]
    hosts = [n for n in walk(root)
             if n.get("nodeType") == 1 and "mermaid" in attrs(n).get("class", "").split()]

    def light(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("children", []):
            yield from light(child)

    light_text = " ".join(n["nodeValue"] for n in light(root) if n.get("nodeType") == 3)
    return hosts, light_text


def drawn(host: dict[str, Any]) -> dict[str, Any] | None:
    """The ``<svg>`` Mermaid drew in this host (material: inside its shadow root), if any."""
    for shadow in host.get("shadowRoots", []):
        for n in walk(shadow):
            if n.get("nodeName", "").lower() == "svg" and "mermaid" in attrs(n).get("id", ""):
                return n
    return None


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for mod in ("mkdocs", "material", "mkdocstrings"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(directory: Path) -> Iterator[str]:
    handler = functools.partial(Quiet, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    yield from serve(site)


@pytest.fixture
def other_server(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "probe.txt").write_text("reachable")
    yield from serve(tmp_path)


@pytest.fixture(scope="module")
def browser(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = find_browser()
    if binary is None:
        pytest.skip("no Chromium/Chrome found (apt-get install chromium, or set XAVIER_BROWSER); "
                    "the offline diagram check needs a browser")
    b = Browser(binary, tmp_path_factory.mktemp("profile"), int(server.rsplit(":", 1)[1]))
    try:
        b.send("Browser.getVersion")
    except RuntimeError as exc:
        b.close()
        pytest.skip(f"{binary} did not start headless: {exc}")
    yield b
    b.close()


# -- the checks -----------------------------------------------------------------------------
def test_the_built_site_references_nothing_off_site(site: Path) -> None:
    """No script, stylesheet or font is fetched from another host (the CDN Mermaid, Google
    Fonts): the pages need only the server they come from."""
    offsite = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        for tag in re.findall(r"<(?:script|link)\b[^>]*>", text):
            if re.search(r"""(?:src|href)=["']?(?:https?:)?//""", tag) and 'rel="canonical"' not in tag:
                offsite.append(f"{page.relative_to(site)}: {tag}")
    assert not offsite, offsite
    assert (site / "assets" / "mermaid" / "mermaid.min.js").exists()
    assert (site / "assets" / "mermaid" / "LICENSE").exists()


def test_the_browser_reaches_only_the_site_server(server: str, browser: Browser, other_server: str) -> None:
    """The isolation the checks rely on: from a page of the site, the site's server answers,
    and another server on another loopback port, or any host name, does not."""
    session = browser.open(f"{server}/")
    deadline = time.monotonic() + WAIT_S
    while browser.send("Runtime.evaluate", {"expression": "document.readyState", "returnByValue": True},
                       session=session)["result"].get("value") != "complete":
        assert time.monotonic() < deadline, "the index page did not load"
        time.sleep(0.1)

    def reach(url: str) -> str:
        expr = f"fetch({url!r}, {{mode: 'no-cors'}}).then(() => 'reached', () => 'blocked')"
        reply = browser.send("Runtime.evaluate", {"expression": expr, "awaitPromise": True,
                                                  "returnByValue": True}, session=session)
        return str(reply["result"]["value"])

    assert reach(f"{server}/search/search_index.json") == "reached"
    assert reach(f"{other_server}/probe.txt") == "blocked"
    assert reach("http://localhost:9/") == "blocked"
    assert reach("https://unpkg.com/mermaid@11/dist/mermaid.min.js") == "blocked"
    browser.send("Page.close", session=session)


def test_every_page_with_a_diagram_is_checked(site: Path) -> None:
    with_diagrams = {p.parent.name for p in site.rglob("index.html")
                     if 'class="mermaid"' in p.read_text(encoding="utf-8")}
    assert with_diagrams == set(EXPECTED)


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_diagrams_draw_offline(page: str, site: Path, server: str, browser: Browser,
                               tmp_path: Path) -> None:
    source = (site / page / "index.html").read_text(encoding="utf-8")
    blocks = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', source, re.S)
    fences = [html.unescape(b) for b in blocks]
    assert fences, f"{page}: no mermaid block in the built page"

    session = browser.open(f"{server}/{page}/")
    deadline = time.monotonic() + WAIT_S
    while True:
        hosts, light_text = diagrams(browser, session)
        svgs = [drawn(h) for h in hosts]
        if len(hosts) == len(fences) and all(svgs):
            break
        if time.monotonic() > deadline:
            shot = browser.send("Page.captureScreenshot", session=session)["data"]
            path = tmp_path / f"{page}.png"
            path.write_bytes(base64.b64decode(shot))
            pytest.fail(f"{page}: {sum(map(bool, svgs))} of {len(fences)} diagrams drawn "
                        f"after {WAIT_S:.0f} s (screenshot {path})")
        time.sleep(0.2)

    drawing = " ".join(texts(svg) for svg in svgs if svg)
    for label in EXPECTED[page]:
        assert label in drawing, f"{page}: {label!r} not in the drawn diagram"
    assert "Syntax error" not in drawing, f"{page}: Mermaid drew its error diagram"
    for fence in fences:  # the source is gone from the page: its first line is not shown
        first = next(line.strip() for line in fence.splitlines()
                     if line.strip() and not line.startswith("%%"))
        assert first not in light_text, f"{page}: the diagram source ({first!r}) is shown"
    browser.send("Page.close", session=session)
