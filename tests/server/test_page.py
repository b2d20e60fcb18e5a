"""The chat page in headless Chromium (Debian's /usr/bin/chromium driven by Playwright): a streamed answer
appears piece by piece, the second turn sends the history and the settings, Stop aborts the server's
request and keeps what was shown, Clear starts over, server errors reach the user: the page served by
`quantkit webui` in front of the scripted server of tests/support/quantkit_testing/fake_openai.py, which records what it got. Then
the page at / of the real `quantkit serve` (and webui in front of it) on a tiny random model."""

from __future__ import annotations

import contextlib
import os
import re
import threading

import pytest
import requests
from playwright.sync_api import sync_playwright

from quantkit_testing.fake_openai import FakeOpenAI
from quantkit_testing.serve_process import SERVED_NAME, wait_for
from quantkit.server.webui import WebUIConfig, WebUIServer

# Debian's package (.ci/run installs it; Playwright's own browser download is not used). Elsewhere, point
# QUANTKIT_CHROMIUM at a Chromium or Chrome binary.
CHROMIUM = os.environ.get("QUANTKIT_CHROMIUM", "/usr/bin/chromium")

ASSISTANT_TEXTS = "() => [...document.querySelectorAll('[data-role=assistant] .text')].map(e => e.textContent)"
IDLE = "() => document.getElementById('log').getAttribute('aria-busy') === 'false'"
# Every text the newest answer shows, with the time it showed it.
RECORD = """() => {
  window.__shown = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('[data-role=assistant] .text');
    if (all.length) window.__shown.push([performance.now(), all[all.length - 1].textContent]);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium, or set QUANTKIT_CHROMIUM")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@contextlib.contextmanager
def chat_page(browser, fake: FakeOpenAI):
    """The page, served by webui in front of `fake`; fails the test on any script error in the page."""
    server = WebUIServer(WebUIConfig(url=fake.url, port=0))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(server.url)
        yield page
        assert not errors, errors
    finally:
        context.close()
        server.shutdown()
        server.server_close()


def say(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_streamed_answer_and_history(browser):
    with FakeOpenAI(delay=0.08) as fake, chat_page(browser, fake) as page:
        page.wait_for_function("() => document.getElementById('model').value === 'fake-model'")
        page.click("#settings summary")
        page.fill("#temperature", "0.3")
        page.fill("#max-tokens", "50")
        page.fill("#system", "be brief")
        page.evaluate(RECORD)
        say(page, "hello")
        answer = "".join(fake.words)
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().at(-1) === {answer!r}", timeout=10_000)
        page.wait_for_function(IDLE)
        shown = page.evaluate("window.__shown")
        stats = page.text_content("#stats")
        say(page, "and again")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().length === 2 && ({ASSISTANT_TEXTS})()[1] === "
                               f"{answer!r}", timeout=10_000)
        page.wait_for_function(IDLE)
        roles = page.eval_on_selector_all("#log article", "els => els.map(e => e.dataset.role)")
    # Streamed: the answer grew through several partial texts, each a prefix of the next, over time.
    texts = [t for _, t in shown if t]
    partial = sorted(set(texts) - {answer}, key=len)
    assert len(partial) >= 4 and all(answer.startswith(t) for t in partial)
    times = [ms for ms, t in shown if t]
    assert (times[-1] - times[0]) / 1000 > 0.3  # 8 chunks 80 ms apart: not all at once
    assert re.fullmatch(r"Last answer: 8 tokens · [\d.]+ tok/s · first token after [\d.]+ s", stats), stats
    first, second = (r.body for r in fake.chats())
    system = {"role": "system", "content": "be brief"}
    assert first["messages"] == [system, {"role": "user", "content": "hello"}]
    assert second["messages"] == [system, {"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "and again"}]
    for body in (first, second):
        assert body["model"] == "fake-model" and body["stream"] is True
        assert body["temperature"] == 0.3 and body["max_tokens"] == 50
        assert body["stream_options"] == {"include_usage": True}
    assert roles == ["user", "assistant", "user", "assistant"]


def test_stop_aborts_the_request_and_clear_starts_over(browser):
    with FakeOpenAI(words=[f"w{i} " for i in range(60)], delay=0.05) as fake, chat_page(browser, fake) as page:
        page.wait_for_function("() => document.getElementById('model').value === 'fake-model'")
        say(page, "tell me everything")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().at(-1).includes('w2 ')", timeout=10_000)
        page.click("#stop")
        page.wait_for_function(IDLE)
        partial = page.evaluate(ASSISTANT_TEXTS)[0]
        note = page.text_content("[data-role=assistant] .note")
        # The 3 s answer was cut at the server (noted there as aborted), not left to run to its end.
        assert wait_for(lambda: fake.aborted or fake.finished, timeout=10.0)
        assert fake.aborted == [fake.requests.index(fake.chats()[0])] and not fake.finished
        fake.words = ["short ", "one"]
        say(page, "go on")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().at(-1) === 'short one'", timeout=10_000)
        page.wait_for_function(IDLE)
        page.click("#clear")
        assert page.evaluate(ASSISTANT_TEXTS) == []
        say(page, "fresh start")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().at(-1) === 'short one'", timeout=10_000)
    assert partial.startswith("w0 w1 w2 ") and "w59" not in partial and note == " [stopped]"
    # What was shown before Stop is part of the next turn's history; after Clear there is none.
    assert fake.chats()[1].body["messages"] == [
        {"role": "user", "content": "tell me everything"}, {"role": "assistant", "content": partial},
        {"role": "user", "content": "go on"}]
    assert fake.chats()[2].body["messages"] == [{"role": "user", "content": "fresh start"}]


def test_server_errors_are_shown(browser):
    with FakeOpenAI(api_key="sk-page") as fake, chat_page(browser, fake) as page:
        page.wait_for_selector("#error:not([hidden])")
        assert page.text_content("#error") == "Could not list the models: missing or wrong API key (HTTP 401)"
        page.click("#settings summary")
        # Typed, then left: one change event, one reload of the models. (A change event sent by hand would
        # leave the field's own change pending until its blur, when the next message is typed; that
        # second reload, finishing after the chat's error, cleared it again: the test then failed under load.)
        page.fill("#api-key", "sk-page")
        page.press("#api-key", "Tab")
        page.wait_for_function("() => document.getElementById('model').value === 'fake-model'")
        assert page.is_hidden("#error")
        fake.fail = (400, "the prompt is 300 tokens, more than the context of 256")
        say(page, "a long prompt")
        page.wait_for_selector("#error:not([hidden])")
        page.wait_for_function(IDLE)
        message = page.text_content("#error")
        left = page.eval_on_selector_all("#log article", "els => els.length")
        restored = page.input_value("#prompt")
    assert message == "the prompt is 300 tokens, more than the context of 256 (HTTP 400)"
    assert left == 0 and restored == "a long prompt"  # the failed turn is taken back for another try
    assert fake.chats()[-1].headers["Authorization"] == "Bearer sk-page"
    assert [r.path for r in fake.requests].count("/v1/models") == 2  # the page's load, the key's change


@pytest.mark.parametrize("front", ["serve", "webui"])
def test_page_against_quantkit_serve(browser, qk_server, front):
    """The page as `quantkit serve` sends it at / (or `quantkit webui` in front of it), against its engine
    (a tiny random model, greedy): each answer is what the server gives for the whole conversation so far."""
    with contextlib.ExitStack() as stack:
        url = qk_server.url + "/"
        if front == "webui":
            server = WebUIServer(WebUIConfig(url=qk_server.url, port=0))
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            url = server.url
        context = browser.new_context()
        stack.callback(context.close)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions")
                else None)
        page.goto(url)
        page.wait_for_function("() => !['', 'loading…'].includes(document.getElementById('model').value)")
        model = page.input_value("#model")
        page.click("#settings summary")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "8")
        say(page, "the model quantizes weights")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().length === 1", timeout=30_000)
        page.wait_for_function(IDLE, timeout=30_000)
        say(page, "and the cache keeps keys")
        page.wait_for_function(f"() => ({ASSISTANT_TEXTS})().length === 2", timeout=30_000)
        page.wait_for_function(IDLE, timeout=30_000)
        answers = page.evaluate(ASSISTANT_TEXTS)
        stats = page.text_content("#stats")
        shown_error = page.is_visible("#error")
    assert not errors and not shown_error
    assert model == SERVED_NAME
    assert len(sent) == 2 and sent[1]["messages"] == [
        {"role": "user", "content": "the model quantizes weights"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "and the cache keeps keys"}]
    for body, answer in zip(sent, answers):
        whole = requests.post(qk_server.url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": body["messages"], "temperature": 0, "max_tokens": 8}).json()
        assert answer == whole["choices"][0]["message"]["content"] and answer
    # The token count is the server's usage (no "≈"), for the last answer.
    assert re.fullmatch(r"Last answer: [1-8] tokens · .* tok/s · first token after [\d.]+ s", stats), stats


def test_page_shows_tool_calls(browser, qk_server):
    """With tools and tool choice `required` in the settings, the page shows the server's call (the tool's
    name and its arguments) as it streams, and sends it back with the next turn as the assistant's
    tool_calls."""
    import json

    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
        "additionalProperties": False}}}
    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions")
                else None)
        page.goto(qk_server.url + "/")
        page.wait_for_function("() => !['', 'loading…'].includes(document.getElementById('model').value)")
        page.click("#settings summary")
        page.fill("#max-tokens", "60")
        page.fill("#tools", json.dumps([tool]))
        page.select_option("#tool-choice", "required")
        say(page, "add")
        page.wait_for_selector("[data-role=assistant] .call .name", timeout=30_000)
        page.wait_for_function(IDLE, timeout=30_000)
        name = page.text_content("[data-role=assistant] .call .name")
        shown_args = page.text_content("[data-role=assistant] .call .args")
        say(page, "again")
        page.wait_for_function("() => document.querySelectorAll('[data-role=assistant]').length === 2",
                               timeout=30_000)
        page.wait_for_function(IDLE, timeout=30_000)
        shown_error = page.is_visible("#error")
    finally:
        context.close()
    assert not errors and not shown_error
    assert name.endswith("add") and 0 <= json.loads(shown_args)["a"] <= 9
    assert sent[0]["tools"] == [tool] and sent[0]["tool_choice"] == "required"
    [call] = sent[1]["messages"][1]["tool_calls"]
    assert sent[1]["messages"][1]["content"] is None and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == json.loads(shown_args) and call["id"].startswith("call_")
