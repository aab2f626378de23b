"""Open an HTML page in headless Chromium (Debian's, driven by playwright) and report what a
reader's browser would show wrong: images that did not load, console errors, links that leave
the page. For the run report's tests; `make test-tools` installs Chromium, the `dev` extra
playwright (never `playwright install`: no browser is downloaded)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# The network is closed where the tests run: without the background-networking flags Chromium
# keeps trying (and failing) to reach its update and sync services.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class BrowserMissing(RuntimeError):
    """Chromium or playwright is not installed."""


@dataclass(frozen=True)
class PageCheck:
    images: list[dict]  # per <img>: alt, complete, naturalWidth
    console_errors: list[str]  # console messages of type error, and uncaught page errors
    outside_links: list[str]  # hrefs of <a>, <link> and <area> that do not point within the page
    requests: list[str]  # every URL the page asked for besides itself and data: URLs
    title: str

    @property
    def broken_images(self) -> list[dict]:
        return [i for i in self.images if not (i["complete"] and i["naturalWidth"] > 0)]


def chromium_executable() -> str:
    """Chromium's path, or `BrowserMissing` saying how to install it and playwright."""
    path = Path(CHROMIUM) if Path(CHROMIUM).exists() else None
    path = path or (Path(found) if (found := shutil.which("chromium")) else None)
    if path is None:
        raise BrowserMissing(f"Chromium is not installed ({CHROMIUM}): run make test-tools "
                             "(Debian: apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        raise BrowserMissing("playwright is not installed: run make setup (the dev extra), then make test-tools") \
            from None
    return str(path)


def check_page(page_path: Path, screenshot: Path | None = None) -> PageCheck:
    """Load `page_path` (file://) in headless Chromium, wait for it to load, save a full-page
    `screenshot` when asked, and return what `PageCheck` holds."""
    executable = chromium_executable()  # first: it names what is missing
    from playwright.sync_api import sync_playwright

    url = Path(page_path).resolve().as_uri()
    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request",
                    lambda r: requests.append(r.url) if r.url != url and not r.url.startswith("data:") else None)
            page.goto(url, wait_until="load")
            images = page.eval_on_selector_all(
                "img", "els => els.map(i => ({alt: i.alt, complete: i.complete, naturalWidth: i.naturalWidth}))")
            hrefs = page.eval_on_selector_all(
                "a[href], link[href], area[href]", "els => els.map(a => a.getAttribute('href'))")
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
            title = page.title()
        finally:
            browser.close()
    return PageCheck(images, errors, [h for h in hrefs if not h.startswith("#")], requests, title)
