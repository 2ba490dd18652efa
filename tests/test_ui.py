"""The built-in chat page (GET /, imp_jax/server/ui.py and static/), driven in a real headless Chromium.

Playwright launches the system's `chromium` (Debian's package; .ci/run installs it): the tests are
skipped, with the reason, only when no such executable exists. The page talks to the session's real
SmolLM2 server; the thinking fold, end_thinking and the API-key prompt use one more server, the tiny
deterministic thinking model of test_reasoning behind `--api-key` (SmolLM2 does not think, and the
session's SmolLM2 servers with keys carry other tests' counters and logs).
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.servers import (MODEL, FakeEngine, LiveServer, app_in_thread, fake_tokenizer, live_server,  # noqa: F401
                             wait_for, wait_idle)
from tiny_models import THINKER_ARGS, write_thinking_model

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
NO_CHROMIUM = "no chromium executable on PATH (Debian: apt-get install chromium); the browser tests need one"
THINK_KEY = "ui-test-key"
TIMEOUT_MS = 60_000
# Snapshots of the last reply's text, and whether a stream was running, at every DOM change.
OBSERVER = """
window.__snaps = [];
new MutationObserver(() => {
  const all = document.querySelectorAll('.msg.assistant .msg-body');
  const body = all[all.length - 1];
  if (!body) return;
  const t = body.textContent, last = window.__snaps[window.__snaps.length - 1];
  if (!last || last.text !== t) window.__snaps.push({text: t, busy: document.body.classList.contains('busy')});
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """The module's one headless Chromium; every test that asks for it is skipped when there is none."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class UiPage:
    """A fresh browser context (empty localStorage) on a server's page, recording every request it makes.

    The context bypasses the page's Content-Security-Policy: Playwright's wait_for_function evaluates
    strings, which the policy forbids. So the XSS test checks the escaping alone, without the policy's help."""

    def __init__(self, browser: Any, url: str, viewport: dict[str, int] | None = None):
        self.url = url
        self.context = browser.new_context(viewport=viewport or {"width": 1200, "height": 800}, accept_downloads=True,
                                           bypass_csp=True)
        self.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.requests: list[Any] = []
        self.errors: list[str] = []
        self.context.on("request", lambda r: self.requests.append(r))
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.add_init_script(OBSERVER)

    def open(self, wait_model: bool = True) -> Any:
        self.page.goto(self.url + "/")
        if wait_model:
            self.page.wait_for_function("document.querySelector('#model').value !== ''")
        return self.page

    def knob(self, name: str, value: Any) -> None:
        self.page.fill(f"#k-{name}", str(value))

    def send(self, text: str) -> None:
        self.page.evaluate("window.__snaps = []")   # snapshots of this reply only
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def wait_done(self) -> None:
        self.page.wait_for_selector("#stop", state="hidden")
        self.page.wait_for_function("!document.body.classList.contains('busy')")

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.post_data) for r in self.requests if r.url.endswith("/v1/chat/completions")]

    def reply(self, i: int = -1) -> str:
        return self.page.locator(".msg.assistant .msg-body").nth(i).inner_text()

    def close(self) -> None:
        """Fails the test if the page went anywhere but its own server or raised a script error."""
        self.context.close()
        foreign = [r.url for r in self.requests if not r.url.startswith((self.url + "/", "data:", "blob:"))]
        assert not foreign, f"the page fetched from elsewhere: {foreign}"
        assert not self.errors, self.errors


@pytest.fixture
def ui(browser: Any, live_server: LiveServer) -> Iterator[UiPage]:
    page = UiPage(browser, live_server.url)
    yield page
    page.close()


# ------------------------------------------------------------------------------------------ serving
def test_page_and_assets_are_small_and_cacheable(live_server: LiveServer):
    page = httpx.get(live_server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache" and "default-src 'none'" in page.headers[
        "content-security-policy"]
    assert httpx.get(live_server.url + "/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
    assets = re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text)
    assert len(assets) == 5 and all("?v=" in a for a in assets)
    total = len(page.content)
    for path in assets:
        r = httpx.get(live_server.url + path)
        assert r.status_code == 200 and "immutable" in r.headers["cache-control"], path
        assert r.headers["etag"].strip('"') == path.split("?v=")[1]
        total += len(r.content)
    assert total < 64 * 1024, f"the page and its assets are {total} bytes"
    stale = httpx.get(live_server.url + assets[0].split("?")[0] + "?v=old")
    assert stale.status_code == 200 and stale.headers["cache-control"] == "no-cache"
    missing = httpx.get(live_server.url + "/ui/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_no_ui_flag_and_the_page_needs_no_key():
    """--no-ui: GET / is the fallback 404; with the page on and keys set, the page loads without one."""
    from imp_jax.server.app import create_app
    from imp_jax.server.config import ServerConfig

    engine = FakeEngine(fake_tokenizer())
    engine.start()
    with app_in_thread(create_app(engine, ServerConfig(ui=False))) as url:
        for path in ("/", "/ui/app.js"):
            r = httpx.get(url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    with app_in_thread(create_app(engine, ServerConfig(api_key=["k"]))) as url:
        assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/ui/style.css").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/nothing").status_code == 401   # an unmatched route still needs the key
    from imp_jax.server.cli import parse_config
    from imp_jax.runtime.config import EngineConfig
    assert parse_config(["--no-ui"], EngineConfig).ui is False and parse_config([], EngineConfig).ui is True


# ------------------------------------------------------------------------------------------ chatting
def test_a_reply_streams_token_by_token(ui: UiPage, live_server: LiveServer):
    page = ui.open()
    page.wait_for_function("document.querySelector('#ctx').textContent === 'ctx 1024'")
    page.wait_for_function("document.querySelector('#k-temperature').placeholder !== ''")   # /props' default
    props = httpx.get(live_server.url + "/props").json()["default_generation_settings"]["params"]
    assert float(page.locator("#k-temperature").get_attribute("placeholder")) == props["temperature"]
    page.wait_for_function("document.querySelector('#health').dataset.state === 'ok'")
    ui.knob("max_tokens", 24)
    ui.send("Write a haiku about the sea.")
    ui.wait_done()
    snaps = page.evaluate("window.__snaps")
    streaming = [s["text"] for s in snaps if s["busy"] and s["text"].strip()]
    assert len(streaming) >= 5, snaps   # the reply grew in the page while the stream ran
    final = ui.reply()
    assert final.strip() and streaming[-1].strip() and len(streaming[0]) < len(final)
    stats = page.locator(".msg.assistant .stats").inner_text()
    assert re.match(r"\d+ tokens · [\d.]+ tok/s · [\d.]+ s", stats), stats
    body = ui.chat_bodies()[-1]
    assert body["stream"] is True and body["max_tokens"] == 24 and body["model"] == "smollm2-135m-instruct"
    assert body["messages"] == [{"role": "user", "content": "Write a haiku about the sea."}]
    page.wait_for_function("/^\\d+ \\/ 1024 tokens$/.test(document.querySelector('#token-count').textContent)")
    before = int(page.locator("#token-count").inner_text().split()[0])
    page.fill("#input", "and one more about the mountains, please")   # the live count follows the draft
    page.wait_for_function(f"parseInt(document.querySelector('#token-count').textContent) > {before}")
    page.click("#server-stats summary")   # counters from /metrics
    page.wait_for_selector("#metrics dt >> text=generated tokens")
    assert int(page.locator("#metrics dt:text-is('generated tokens') + dd").inner_text()) >= 1


def test_stop_regenerate_edit_and_the_knobs_in_the_request(ui: UiPage, live_server: LiveServer):
    page = ui.open()
    ui.knob("max_tokens", 400)
    ui.knob("temperature", 0.8)
    ui.send("Tell me a long story about a dragon.")
    page.wait_for_function("window.__snaps.filter(s => s.busy && s.text.length).length >= 3")
    page.click("#stop")   # aborts the fetch; the server cancels the request
    ui.wait_done()
    assert "stopped" in page.locator(".msg.assistant .stats").inner_text()
    assert wait_idle(live_server.url, timeout=30)["num_running"] == 0
    assert ui.chat_bodies()[-1]["temperature"] == 0.8

    ui.knob("max_tokens", 12)
    ui.knob("temperature", 0)
    ui.knob("seed", 7)
    page.click(".msg.assistant .msg-regen")
    ui.wait_done()
    first = ui.reply()
    page.click(".msg.assistant .msg-regen")   # greedy: the same answer again, replacing the first
    ui.wait_done()
    assert page.locator(".msg.assistant").count() == 1 and ui.reply() == first
    regen = ui.chat_bodies()[-2:]
    assert regen[0] == regen[1] and regen[1]["temperature"] == 0 and regen[1]["seed"] == 7
    assert regen[1]["messages"] == [{"role": "user", "content": "Tell me a long story about a dragon."}]

    page.click(".msg.user .msg-edit")
    page.fill(".edit-box", "Name three colours.")
    page.click(".edit-send")
    ui.wait_done()
    assert page.locator(".msg.user .msg-body").all_inner_texts() == ["Name three colours."]
    assert ui.chat_bodies()[-1]["messages"] == [{"role": "user", "content": "Name three colours."}]

    ui.knob("max_tokens", 400)   # Esc stops too
    ui.send("Now a long poem.")
    page.wait_for_function("window.__snaps.filter(s => s.busy && s.text.length).length >= 2")
    page.keyboard.press("Escape")
    ui.wait_done()
    assert "stopped" in page.locator(".msg.assistant .stats").nth(1).inner_text()
    assert wait_idle(live_server.url, timeout=30)["num_running"] == 0


def test_conversations_survive_a_reload_and_are_renamed_exported_deleted(ui: UiPage, tmp_path: Path):
    page = ui.open()
    ui.knob("max_tokens", 6)
    page.fill("#system", "You answer briefly.")
    ui.send("Hello there")
    ui.wait_done()
    answer = ui.reply()
    assert ui.chat_bodies()[-1]["messages"][0] == {"role": "system", "content": "You answer briefly."}
    page.click("#new-chat")
    ui.send("Second chat")
    ui.wait_done()
    page.reload()
    page.wait_for_function("document.querySelector('#model').value !== ''")
    assert page.locator(".conv-title").all_inner_texts() == ["Second chat", "Hello there"]
    assert page.locator("#k-max_tokens").input_value() == "6" and page.locator("#system").input_value()
    page.click(".conv-title >> text=Hello there")
    assert page.locator(".msg.user .msg-body").inner_text() == "Hello there" and ui.reply() == answer
    page.once("dialog", lambda d: d.accept("Greetings"))
    page.locator(".conv", has_text="Hello there").locator(".conv-rename").click()
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert [c["title"] for c in exported["conversations"]] == ["Second chat", "Greetings"]
    # the page's text of the reply is rendered Markdown (a space before a line break is not shown)
    assert " ".join(exported["conversations"][1]["messages"][1]["content"].split()) == " ".join(answer.split())
    page.once("dialog", lambda d: d.accept())
    page.locator(".conv", has_text="Second chat").locator(".conv-delete").click()
    page.reload()
    page.wait_for_selector(".conv-title")
    assert page.locator(".conv-title").all_inner_texts() == ["Greetings"]


def test_model_html_is_shown_as_text(ui: UiPage):
    """A reply's HTML (here from a canned stream) never becomes markup; only safe links are links."""
    reply = ("Hi <img src=x onerror=\"window.__xss=1\"> **bold** [ok](https://example.com) "
             "[bad](javascript:window.__xss=2)\n\n```html\n<script>window.__xss=3</script>\n```\n"
             "## Head\n\n- one\n- two\n\n| a | b |\n|---|---|\n| <i>1</i> | 2 |\n\n"
             "```python\ndef f():\n    return 1  # c\n```\n")
    frames = [{"id": "chatcmpl-x", "choices": [{"index": 0, "delta": {"content": reply[i:i + 9]},
                                                "finish_reason": None}]} for i in range(0, len(reply), 9)]
    sse = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
    page = ui.open()
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    ui.send("<b>user html</b>")
    ui.wait_done()
    body = page.locator(".msg.assistant .msg-body")
    assert body.locator("img, script").count() == 0 and page.evaluate("window.__xss") is None
    assert "<img src=x" in body.inner_text() and "<script>" in body.locator("pre code").first.inner_text()
    assert body.locator("strong").inner_text() == "bold"
    links = body.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com"
    assert links.get_attribute("rel") == "noopener noreferrer"
    assert body.locator("h2").inner_text() == "Head" and body.locator("ul > li").all_inner_texts() == ["one", "two"]
    assert body.locator("td").first.inner_text() == "<i>1</i>" and body.locator("i").count() == 0
    python = body.locator(".code-block").nth(1)   # the highlighter
    assert python.locator(".code-head span").inner_text() == "python"
    python.locator(".copy-code").click()
    page.wait_for_function("navigator.clipboard.readText().then(t => t.startsWith('def f'))")
    assert page.evaluate("navigator.clipboard.readText()") == "def f():\n    return 1  # c"
    assert python.locator(".tok-k").all_inner_texts() == ["def", "return"]
    assert python.locator(".tok-c").all_inner_texts() == ["# c"] and python.locator(".tok-n").all_inner_texts() == ["1"]
    assert page.locator(".msg.user .msg-body").inner_text() == "<b>user html</b>"
    assert page.locator(".msg.user b").count() == 0


def test_phone_width_and_both_themes(browser: Any, live_server: LiveServer, tmp_path: Path):
    for name, viewport in (("desktop", {"width": 1200, "height": 760}), ("phone", {"width": 390, "height": 800})):
        ui = UiPage(browser, live_server.url, viewport)
        try:
            page = ui.open()
            ui.knob("max_tokens", 40)
            ui.send("Show a tiny Python example that prints hello.")
            ui.wait_done()
            assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
            if name == "phone":
                assert not page.locator("#sidebar").is_visible() or page.locator("#sidebar").bounding_box()["x"] < 0
                page.click("#open-sidebar")
                page.wait_for_function("document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
                page.click("#scrim", position={"x": 380, "y": 400})
                page.click("#open-settings")   # the settings slide in from the right, usable at this width
                page.wait_for_function("document.querySelector('#settings').getBoundingClientRect().right <= 390")
                page.wait_for_timeout(250)
                page.screenshot(path=str(tmp_path / "ui-phone-settings.png"))
                assert page.locator("#k-temperature").bounding_box()["x"] >= 0
                page.click("#scrim", position={"x": 20, "y": 400})
                page.wait_for_function("document.querySelector('#settings').getBoundingClientRect().x >= 390")
            for theme in ("light", "dark"):
                if page.evaluate("document.documentElement.dataset.theme") != theme:
                    page.click("#theme")
                page.wait_for_timeout(250)   # the panels' slide transition
                shot = tmp_path / f"ui-{name}-{theme}.png"
                page.screenshot(path=str(shot))
                assert shot.stat().st_size > 5000
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            page.reload()   # the theme is kept
            assert page.evaluate("getComputedStyle(document.body).backgroundColor") == background
        finally:
            ui.close()


# ------------------------------------------------------------------------------------------ thinking + key
@pytest.fixture(scope="module")
def keyed_thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny thinking model (test_reasoning's, same sizing: its programs come from the compile cache)
    behind an API key."""
    path = tmp_path_factory.mktemp("ui-models") / "thinker"
    path.mkdir()
    write_thinking_model(path)
    live = LiveServer(["--model", str(path), *THINKER_ARGS, "--api-key", THINK_KEY],
                      tmp_path_factory.mktemp("ui-thinker-log") / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=600, proc=live.proc)
        yield live
    finally:
        live.stop()


def test_api_key_prompt_thinking_fold_and_end_thinking(browser: Any, keyed_thinker: LiveServer):
    ui = UiPage(browser, keyed_thinker.url)
    try:
        page = ui.open(wait_model=False)
        page.wait_for_selector("#key-dialog[open]")   # /v1/models answered 401
        page.fill("#key-input", "wrong")
        page.click("#key-save")
        page.wait_for_function("document.querySelector('#key-why').textContent.includes('refused')")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", THINK_KEY)
        page.click("#key-save")
        page.wait_for_function("document.querySelector('#model').value === 'thinker'")
        ui.knob("temperature", 0)
        ui.send("hello")
        ui.wait_done()
        msg = page.locator(".msg.assistant")
        assert msg.locator(".think-body").text_content() == "Hmm so" and ui.reply() == "Yes done"
        assert not msg.locator(".think").evaluate("d => d.open")   # folded once the answer is there
        assert all(r.headers.get("authorization") == f"Bearer {THINK_KEY}"
                   for r in ui.requests if r.url.endswith(("/v1/chat/completions", "/tokenize")))

        # A reply that would think forever ("<think>ok" continued), ended from the page's button.
        def loop(route: Any) -> None:
            body = json.loads(route.request.post_data)
            body["messages"].append({"role": "assistant", "content": "<think>ok"})
            body.update(continue_final_message=True, add_generation_prompt=False, max_tokens=2000)
            route.continue_(post_data=json.dumps(body))
        page.route("**/v1/chat/completions", loop)
        ui.send("think")
        page.wait_for_function("(document.querySelector('.msg.assistant:last-child .think-body') || {})"
                               ".textContent?.startsWith('okok')")
        page.locator(".msg.assistant").last.locator(".end-thinking").click()
        ui.wait_done()
        assert ui.reply() == "Yes done" and set(page.locator(".think-body").last.text_content().split("ok")) == {""}
        assert wait_idle(keyed_thinker.url, timeout=30, key=THINK_KEY)["num_running"] == 0

        page.reload()   # the key was kept: no prompt this time
        page.wait_for_function("document.querySelector('#model').value === 'thinker'")
        assert not page.locator("#key-dialog").evaluate("d => d.open")
        assert page.locator(".msg.assistant .think-body").first.text_content() == "Hmm so"
    finally:
        ui.close()


# ------------------------------------------------------------------------------------------ images
def _png(color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, format="PNG")
    return out.getvalue()


PASTE = """b64 => {   // what a Ctrl+V of a copied image dispatches: a paste whose clipboardData holds the file
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0)), dt = new DataTransfer();
  dt.items.add(new File([bytes], 'image.png', {type: 'image/png'}));
  document.querySelector('#input').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true,
                                                                              cancelable: true}));
}"""


# A PNG header and zeros, one byte past 20 MiB, dropped on the composer: made in the page, since 20 MiB
# through set_input_files costs Playwright's pipe about 15 s.
DROP_HUGE = """b64 => {
  const head = Uint8Array.from(atob(b64), c => c.charCodeAt(0)), dt = new DataTransfer();
  dt.items.add(new File([head, new Uint8Array((20 << 20) + 1 - head.length)], 'huge.png', {type: 'image/png'}));
  document.querySelector('#composer').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true,
                                                                           cancelable: true}));
}"""


def test_images_attached_pasted_refused_sent_and_the_servers_refusal_shown(ui: UiPage):
    """The real server: SmolLM2 has no vision encoder, so the image reaches it and is refused (400
    model_not_multimodal), which the page must show; the request bodies are read from the browser's side."""
    import base64

    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    page = ui.open()
    page.set_input_files("#file", files=[{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    page.wait_for_selector("#attachments .thumb img")
    assert page.locator("#attachments img").evaluate("i => i.complete && i.naturalWidth") == 8   # a real image
    page.evaluate(PASTE, base64.b64encode(blue).decode())
    page.wait_for_function("document.querySelectorAll('#attachments .thumb img').length === 2")
    page.locator("#attachments .thumb-remove").nth(1).click()   # the pasted one goes again
    assert page.locator("#attachments img").count() == 1

    # Refused, each with a line saying why: text, and text named .png (the bytes decide, not the name).
    page.set_input_files("#file", files=[
        {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"},
        {"name": "fake.png", "mimeType": "image/png", "buffer": b"hello, not a png"}])
    page.wait_for_selector("#attach-error:not([hidden])")
    lines = page.locator("#attach-error").inner_text().split("\n")
    assert lines[:2] == ["notes.txt: not a PNG, JPEG, WebP or GIF image", "fake.png: not a PNG, JPEG, WebP or GIF image"]
    assert lines[2:] == [f"the served model {MODEL} has no vision encoder: it will refuse images"]   # /props said
    page.evaluate(DROP_HUGE, base64.b64encode(red[:16]).decode())   # one byte past 20 MiB
    page.wait_for_function("document.querySelector('#attach-error').textContent.startsWith('huge.png')")
    assert page.locator("#attach-error").inner_text().split("\n")[0] == \
        "huge.png: 20.0 MiB, over the 20 MiB the server takes for an image"   # /props' image_limits
    assert page.locator("#attachments img").count() == 1

    ui.send("What is in this picture?")
    ui.wait_done()
    url = "data:image/png;base64," + base64.b64encode(red).decode()
    sent = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    assert ui.chat_bodies()[-1]["messages"] == sent
    error = page.locator(".msg.assistant .msg-error").inner_text()
    assert "no vision encoder" in error and "messages[0].content[1]" in error, error
    assert page.locator(".msg.user .msg-images img").get_attribute("src") == url
    assert page.locator(".msg.user .msg-body").inner_text() == "What is in this picture?"
    assert page.locator("#attachments").is_hidden() and page.locator("#attach-error").is_hidden()
    assert not any("image_url" in (r.post_data or "") for r in ui.requests if r.url.endswith("/tokenize"))

    ui.send("And now?")   # the earlier turn's image is sent again with the history
    ui.wait_done()
    assert ui.chat_bodies()[-1]["messages"] == [*sent, {"role": "user", "content": "And now?"}]
    assert page.locator(".msg.assistant .msg-error").count() == 2
    page.reload()   # kept in localStorage with the conversation
    page.wait_for_selector(".msg.user .msg-images img")
    assert page.locator(".msg.user .msg-images img").get_attribute("src") == url

    ui.knob("max_tokens", 4)   # Edit keeps the images unless removed (✕): text only now, which SmolLM2 answers
    page.locator(".msg.user .msg-edit").first.click()
    page.click(".msg.user .msg-images .thumb-remove")
    assert page.locator(".msg.user .msg-images .thumb").count() == 0
    page.click(".edit-send")
    ui.wait_done()
    assert ui.chat_bodies()[-1]["messages"] == [{"role": "user", "content": "What is in this picture?"}]
    assert ui.reply().strip() and page.locator("#messages .msg-images, #messages .msg-error").count() == 0


def test_a_big_image_the_servers_413_and_a_full_storage(ui: UiPage):
    """6 MiB (a PNG header and zeros: the page checks only the header) is past this server's request body
    limit (4 MiB at a 1024-token context) and past what localStorage holds: the 413's message is shown, and
    the conversation is kept without the image, which is then not sent again."""
    import base64

    page = ui.open()
    ui.knob("max_tokens", 4)
    page.evaluate(DROP_HUGE.replace("(20 << 20) + 1", "(6 << 20)").replace("huge.png", "big.png"),
                  base64.b64encode(_png((0, 255, 0))[:16]).decode())
    page.wait_for_selector("#attachments .thumb img")
    ui.send("Big one")
    ui.wait_done()
    error = page.locator(".msg.assistant .msg-error").inner_text()
    assert re.fullmatch(r"the request body has \d+ bytes; this server takes at most 4194304", error), error
    assert page.locator("#toast").inner_text() == "Images are not kept across a reload: the browser's storage is full"
    page.reload()
    page.wait_for_function("document.querySelector('#model').value !== ''")
    assert page.locator(".msg.user .msg-images .thumb.gone").inner_text() == "image not kept"
    ui.send("Small now")
    ui.wait_done()
    assert ui.chat_bodies()[-1]["messages"] == [{"role": "user", "content": "Big one"},
                                                {"role": "user", "content": "Small now"}]
    assert ui.reply().strip()
