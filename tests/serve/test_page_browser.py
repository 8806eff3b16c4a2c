"""The chat page in a real headless Chromium (Selenium, the system's chromium + chromedriver): it loads the models, a
message streams an answer into the conversation, stop ends an answer mid-stream, and switching to an adapter
changes the answer. ``make test-browser`` installs what it needs and runs this."""

from __future__ import annotations

import shutil
import time

import pytest

pytestmark = pytest.mark.browser
webdriver = pytest.importorskip("selenium.webdriver")

SYSTEM = "Be brief."  # with it, the tiny model's greedy answers to these messages are not empty
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs chromium and chromedriver (make test-browser installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _until(check, timeout=30.0, what="the page"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _answers(driver) -> list[str]:
    return [e.get_attribute("textContent") for e in driver.find_elements("css selector", "#log .msg.assistant")]


def _idle(driver) -> bool:
    return driver.find_element("id", "send").is_enabled() and not driver.find_element("id", "stop").is_enabled()


def _send(driver, text: str) -> str:
    """Type ``text``, press Enter, wait for the answer to finish; returns it."""
    n = len(_answers(driver))
    box = driver.find_element("id", "input")
    box.send_keys(text)
    box.send_keys("\n")
    _until(lambda: len(_answers(driver)) == n + 1 and _idle(driver), what="the answer to finish")
    return _answers(driver)[-1]


def _api_answer(url: str, model: str, text: str, *, max_tokens: int) -> str:
    """The server's non-streamed chat answer to the page's request (greedy, top_p 1, the system message)."""
    import httpx

    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "temperature": 0, "top_p": 1,
        "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def _choose_model(driver, name: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", "model")).select_by_value(name)


@pytest.fixture
def slow_engine(served):
    """The server's decoding loop slowed to ~20 steps/s, so that the page sees tokens arrive one by one and stop
    lands mid-answer (the tiny model decodes a whole answer within one network read otherwise)."""
    engine = served.server.engine
    step = engine._step
    engine._step = lambda: (time.sleep(0.05), step())[1]
    yield engine
    del engine._step


def _log(driver) -> str:
    return driver.find_element("id", "log").get_attribute("innerHTML")


def test_chat_page_in_chromium(browser, served, slow_engine):
    d = browser
    d.get(served.url + "/")
    options = _until(lambda: [o.get_attribute("value") for o in d.find_elements("css selector", "#model option")],
                     what="the model list")
    assert "lora" in options and len(options) == 2
    assert "parameters" in d.find_element("id", "card").text  # the model card
    base = options[0]
    d.find_element("id", "system").send_keys(SYSTEM)
    max_tokens = d.find_element("id", "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("24")

    # a message streams an answer into the conversation: the log changes in many separate moments while it streams
    d.execute_script("""
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
            .observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});""")
    answer = _send(d, "Hello there")
    assert answer, _log(d)  # (the tiny random model's greedy answer may be all newlines: textContent, not .text)
    assert d.execute_script("return window.updates") >= 10, _log(d)  # separate batches of DOM changes
    assert [e.text for e in d.find_elements("css selector", "#log .msg.user")] == ["Hello there"]
    assert answer == _api_answer(served.url, base, "Hello there", max_tokens=24)  # what the API answers alone

    # stop, after the first tokens: the page is idle again at once, nothing more arrives, the server cancels the row
    d.find_element("id", "reset").click()
    max_tokens.clear()
    max_tokens.send_keys("64")
    box = d.find_element("id", "input")
    box.send_keys("Tell me a long story")
    box.send_keys("\n")
    _until(lambda: (_answers(d) or [""])[-1], what="the first streamed tokens")
    d.find_element("id", "stop").click()
    _until(lambda: _idle(d), timeout=2, what="stop to end the answer")
    assert len(_answers(d)) == 1, _log(d)  # the stopped answer stays in the conversation, not as an error
    stopped = _answers(d)[-1]
    time.sleep(0.5)
    assert _answers(d)[-1] == stopped  # nothing arrives after stop
    _until(lambda: slow_engine.load["running"] == 0, timeout=5, what="the server to cancel the sequence")
    full = _api_answer(served.url, base, "Tell me a long story", max_tokens=64)
    assert full.startswith(stopped) and len(stopped) < len(full)

    # switching to the adapter changes the answer to the same message
    d.find_element("id", "reset").click()
    max_tokens.clear()
    max_tokens.send_keys("24")
    _choose_model(d, "lora")
    with_adapter = _send(d, "Hello there")
    assert with_adapter == _api_answer(served.url, "lora", "Hello there", max_tokens=24)
    assert with_adapter != answer
