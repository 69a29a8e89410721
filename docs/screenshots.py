"""The chat page's screenshots in README and docs/web.md (docs/images/web-*.png), taken the way
tests/test_web.py drives the page: Playwright with Debian's Chromium, against a real
`adaptive-llama serve` on the bundled model.

    .venv/bin/python docs/screenshots.py
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

IMAGES = Path(__file__).with_name("images")
QUESTION = "Name three rivers and one fact about each."


def main() -> None:
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "serve", "--port",
                               str(port), "--ctx", "2048"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit("the server did not start")
                time.sleep(0.2)
        IMAGES.mkdir(exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=os.environ.get("ADAPTIVE_LLAMA_CHROMIUM")
                or shutil.which("chromium"),
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"])
            shoot_token_view(browser, port)
            shoot_streaming(browser, port)
            shoot_branches(browser, port)
            shoot_phone(browser, port)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def settle(page) -> None:
    page.wait_for_selector("#stop", state="hidden", timeout=120_000)
    page.wait_for_selector("#send", state="visible")


def ask(page, port: int, seed: int, question: str = QUESTION, max_tokens: int = 90,
        wait: bool = True) -> None:
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_selector("#model option", state="attached")
    page.click("#open-settings")
    page.fill("#seed", str(seed))
    page.fill("#max-tokens", str(max_tokens))
    page.click("#close-settings")
    say(page, question, wait)


def say(page, question: str, wait: bool = True) -> None:
    page.fill("#input", question)
    page.press("#input", "Enter")
    if wait:
        settle(page)


def shoot_token_view(browser, port: int) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 760}, color_scheme="light")
    ask(page, port, seed=3)
    page.check("#token-view")
    page.locator(".message.assistant .tok").nth(6).hover()
    page.screenshot(path=IMAGES / "web-token-view.png")
    page.mouse.move(0, 0)
    page.click(".message.assistant .compare")
    page.fill("#compare-spec", "greedy")
    page.click("#compare-run")
    settle(page)
    page.click("#theme")
    page.locator(".comparison").scroll_into_view_if_needed()
    page.screenshot(path=IMAGES / "web-compare.png")
    page.close()


def shoot_streaming(browser, port: int) -> None:
    """The question, and under it its reply as it streams, markdown drawn."""
    page = browser.new_page(viewport={"width": 1200, "height": 600}, color_scheme="light")
    ask(page, port, seed=4, question="Give me three tips for a first trip to Norway, "
        "as a list.", max_tokens=300, wait=False)
    # polled from here: the page's policy forbids the string evaluation wait_for_function does
    while not page.evaluate("document.querySelector('.content.streaming')?.textContent"
                            ".length > 160"):
        time.sleep(0.05)
    page.screenshot(path=IMAGES / "web-streaming.png")
    settle(page)
    page.close()


def shoot_branches(browser, port: int) -> None:
    """A question edited after a second turn: the new version, with ‹ 2/2 › back to the
    branch it replaced."""
    page = browser.new_page(viewport={"width": 1200, "height": 560}, color_scheme="dark")
    ask(page, port, seed=5, question="Name a colour.", max_tokens=30)
    say(page, "And a second one?")
    page.locator(".message.user .edit").first.click()
    page.fill(".edit-area", "Name a fruit.")
    page.press(".edit-area", "Enter")
    settle(page)
    page.mouse.move(0, 0)
    page.screenshot(path=IMAGES / "web-branches.png")
    page.close()


def shoot_phone(browser, port: int) -> None:
    page = browser.new_page(viewport={"width": 390, "height": 780}, color_scheme="dark",
                            device_scale_factor=2)
    ask(page, port, seed=8)
    page.screenshot(path=IMAGES / "web-phone.png")
    page.close()


if __name__ == "__main__":
    main()
