"""The web console's browser tests: Debian's chromium driven by Playwright for Python (no browser is
downloaded), the screenshots they write, and what every screen must keep — the composer on the
screen and nothing wider than it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

#: The two screens the console is checked on: a laptop's and a phone's (an iPhone 12-14's CSS pixels).
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def screenshot(locator: Page | Locator, tmp_path: Path, name: str) -> None:
    """To `tmp_path`, and to `TL_CONSOLE_SCREENSHOTS` when it names a directory (`docs`: the docs' images)."""
    locator.screenshot(path=str(tmp_path / name))
    target = os.environ.get("TL_CONSOLE_SCREENSHOTS")
    if target:
        shutil.copy(tmp_path / name, Path(target) / name)


def assert_fits(page: Page) -> None:
    """The composer (the message field, Send and Stop) is inside the window, and the page does not
    scroll sideways."""
    size = page.viewport_size
    assert size is not None
    width, height = size["width"], size["height"]
    wide = page.evaluate("[document.documentElement.scrollWidth, document.body.scrollWidth]")
    assert max(wide) <= width, f"the page is {max(wide)} px wide in a {width} px window"
    for part in ("#query", "#send", "#stop"):
        box = page.locator(part).bounding_box()
        assert box is not None, f"{part} is not shown"
        assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= width + 0.5 \
            and box["y"] + box["height"] <= height + 0.5, f"{part} is off the screen: {box} in {width}x{height}"
