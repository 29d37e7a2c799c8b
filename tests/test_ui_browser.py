"""The web page of `gptlab serve` in a real headless Chromium (Playwright driving Debian's chromium): it loads
with no console errors and no request leaving the server, a chat message gets a streamed answer, and hovering a
token shows the weights the JSON endpoint returns, the per-head grid paints each head's cached attention pattern, and
the patching view draws the /ui/patch values with the tokens as labels.

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
import torch  # noqa: E402

from gptlab.hooks import run_with_cache  # noqa: E402
from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?'\n"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def served():
    """A tiny grouped-query model (4 query heads, 2 key/value heads) and its char tokenizer."""
    tok = CharTokenizer.from_text(CHARS)
    return tiny_model(vocab_size=tok.vocab_size, block_size=128), tok


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:  # one per process: a second one inside it refuses to start
        browser = pw.chromium.launch(executable_path=shutil.which(CHROMIUM) or CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page_on_server(served, browser):
    model, tok = served
    app = create_app(model, tok, model_name="tiny")
    with ServerThread(app) as server:
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
        page.close()


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



def test_switching_layer_after_editing_the_text_keeps_tokens_and_lens_together(page_on_server):
    """The layer or head select after an edit of the text (without pressing look) shows the new text's tokens:
    its lens must be the new text's too, not the old one's (whose positions run out: a page error on hover)."""
    server, page, errors, _ = page_on_server
    page.fill("#explore-input", "abc")
    page.click("#analyze")
    page.wait_for_selector("#tokens[data-ready=true]")
    text = "abcdefgh"
    page.fill("#explore-input", text)
    page.select_option("#layer", "0")
    page.select_option("#layer", "1")
    page.wait_for_function(f"document.querySelectorAll('#tokens .tok').length === {len(text)}")
    page.locator("#tokens .tok").nth(6).hover()
    lens = httpx.post(server.url + "/ui/lens", json={"text": text, "top_k": 3}).json()
    rows = page.locator("#lens tr")
    assert rows.count() == 1 + 3
    first = lens["top"][0][6][0]
    assert rows.nth(1).inner_text().split("\t")[1].startswith(f'"{first["token"]}" {first["prob"]:.2f}')
    assert errors == []

PAINT = "(h) => { const c = document.querySelectorAll('#head-grid canvas')[h];" \
        " return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"


def painted_weights(page, head: int, size: int) -> torch.Tensor:
    """The weights a head's canvas shows, read back from its pixels: white (0) to (217, 72, 15) (1), one pixel
    per (query, key); the green channel is 255 - 183 w, rounded."""
    rgba = torch.tensor(page.evaluate(PAINT, head), dtype=torch.float32).view(size, size, 4)
    return (255 - rgba[..., 1]) / 183


def test_head_grid_paints_every_heads_cached_pattern(page_on_server, served):
    server, page, errors, _ = page_on_server
    model, tok = served
    text = "To be or not"
    page.fill("#explore-input", text)
    page.select_option("#layer", "1")
    page.click("#analyze")
    page.wait_for_selector("#tokens[data-ready=true]")
    cells = page.locator("#head-grid .head-cell")
    assert cells.count() == model.config.n_head == 4 and model.config.n_kv_head == 2
    _, cache = run_with_cache(model, tok.encode(text), ["blocks.1.attn.hook_pattern"])
    for h in range(4):
        torch.testing.assert_close(painted_weights(page, h, len(text)), cache["blocks.1.attn.hook_pattern"][0, h],
                                   atol=0.6 / 183, rtol=0)
    cells.nth(2).click()
    assert page.get_attribute("#head-large-box", "data-head") == "2" and page.is_visible("#head-large")
    page.hover("#head-large", position={"x": 358, "y": 358})  # the last query's weight on itself
    expected = cache["blocks.1.attn.hook_pattern"][0, 2, -1, -1].item()
    assert page.inner_text("#head-readout").endswith(f"{expected:.4f}")
    assert errors == []


def test_patching_view_draws_the_routes_values_with_token_labels(page_on_server, served):
    server, page, errors, _ = page_on_server
    model, _ = served
    body = {"clean": "the cat sat", "corrupt": "the dog sat", "point": "resid_pre", "answer": "a", "wrong": "b"}
    page.fill("#patch-clean", body["clean"])
    page.fill("#patch-corrupt", body["corrupt"])
    page.fill("#patch-answer", "a")
    page.fill("#patch-wrong", "b")
    page.click("#patch-run")
    page.wait_for_selector("#patch-map[data-ready=true]")
    expected = httpx.post(server.url + "/ui/patch", json=body).json()
    assert page.locator("#patch-map thead th").all_inner_texts() == ["layer", *body["clean"]]
    rows = page.locator("#patch-map tbody tr")
    assert rows.count() == model.config.n_layer
    for layer in range(model.config.n_layer):
        cells = rows.nth(layer).locator("td")
        shown = [float(cells.nth(k).get_attribute("data-value")) for k in range(len(body["clean"]))]
        assert shown == expected["values"][layer]
        assert cells.nth(4).get_attribute("title").endswith(f"{expected['values'][layer][4]:.4f}")
    assert page.locator("#patch-scale .bar").count() == 1
    page.select_option("#patch-point", "z")
    page.click("#patch-run")
    page.wait_for_function("document.querySelectorAll('#patch-map thead th').length === 5")
    assert page.locator("#patch-map thead th").all_inner_texts() == ["layer", "head 0", "head 1", "head 2", "head 3"]
    assert errors == []


def test_a_message_the_server_refuses_leaves_the_conversation_as_it_was(page_on_server):
    """A 400 (a message too long for the context) shows the error, and the message goes back to the input: the
    page does not keep showing a turn that the next request will not send."""
    _, page, errors, _ = page_on_server
    shown, history = page.locator(".msg").count(), page.evaluate("JSON.stringify(state.history)")
    text = "a" * 200  # 200 characters: more than the context of 128
    page.fill("#chat-input", text)
    page.click("#send")
    page.wait_for_function("document.querySelector('#error').textContent.includes('context')")
    page.wait_for_function("!document.querySelector('#send').disabled")
    assert page.locator(".msg").count() == shown and page.evaluate("JSON.stringify(state.history)") == history
    assert page.input_value("#chat-input") == text
    assert all("status of 400" in e for e in errors)  # the browser's own note of the refused request
    errors.clear()

def test_a_non_ascii_api_key_typed_into_the_page_is_sent_as_utf8(served, browser):
    """The server compares the key as UTF-8 bytes (`serve.access`); the page sends those bytes, where a header
    holding the typed string itself fails in fetch (a character past U+00FF) or sends Latin-1 bytes."""
    model, tok = served
    key = "clé-ключ"
    with ServerThread(create_app(model, tok, model_name="tiny", api_key=key)) as server:
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url + "/")
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#key", key)
        page.click("#key-form button")
        page.wait_for_selector("body[data-ready=true]")
        assert page.inner_text("#model-name") == "tiny" and page.inner_text("#error") == ""
        page.close()
