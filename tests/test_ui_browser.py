"""The web page of `gptlab serve` in a real headless Chromium (Playwright driving Debian's chromium): it loads
with no console errors and no request leaving the server, a chat message gets a streamed answer, and hovering a
token shows the weights the JSON endpoint returns.

Needs `pip install playwright` and `apt-get install chromium` (never `playwright install`: no downloads); skipped
with the reason when either is missing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import tiny_model

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytest.importorskip("fastapi")

import httpx  # noqa: E402

from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?'\n"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def page_on_server():
    tok = CharTokenizer.from_text(CHARS)
    app = create_app(tiny_model(vocab_size=tok.vocab_size, block_size=128), tok, model_name="tiny")
    with ServerThread(app) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which(CHROMIUM) or CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        outside: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((server.url, "data:")) else None)
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        yield server, page, errors, outside
        browser.close()


def test_page_loads_without_console_errors_or_outside_requests(page_on_server):
    _, page, errors, outside = page_on_server
    assert page.inner_text("#model-name") == "tiny"
    assert page.locator("#layer option").count() == 2 and page.locator("#head option").count() == 5
    assert errors == [] and outside == []


def test_chat_message_gets_a_streamed_answer(page_on_server):
    _, page, errors, _ = page_on_server
    page.fill("#max-tokens", "12")
    page.fill("#chat-input", "Hello there")
    page.click("#send")
    answer = page.wait_for_selector(".msg.assistant[data-done=true]")
    assert page.inner_text(".msg.user") == "Hello there"
    assert len(answer.inner_text()) > 0
    assert errors == []


def test_hovering_a_token_shows_the_endpoints_weights(page_on_server):
    server, page, errors, _ = page_on_server
    text = "To be or not"
    page.fill("#explore-input", text)
    page.select_option("#layer", "1")
    page.select_option("#head", "2")
    page.click("#analyze")
    page.wait_for_selector("#tokens[data-ready=true]")
    tokens = page.locator("#tokens .tok")
    assert tokens.count() == len(text)
    expected = httpx.post(server.url + "/ui/attention", json={"text": text, "layer": 1, "head": 2}).json()["weights"]
    for i in (0, 5, len(text) - 1):
        tokens.nth(i).hover()
        shown = [tokens.nth(j).get_attribute("data-weight") for j in range(len(text))]
        assert [float(w) for w in shown[: i + 1]] == pytest.approx(expected[i][: i + 1], abs=1e-9)
        assert shown[i + 1:] == [None] * (len(text) - i - 1)  # nothing after the token: causal
        assert page.locator("#lens tr").count() == 1 + 3  # header + embeddings and two layers
    assert errors == []
