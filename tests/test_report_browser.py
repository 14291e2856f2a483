"""The HTML report in a real browser: headless Chromium renders its sections and its SVG, and
the page makes no network request. Skipped where no Chromium is installed
(`apt-get install chromium`, or point AMPSCOPE_CHROMIUM at a Chromium or Chrome binary).

Chromium is driven by its own command line (`--dump-dom`, `--screenshot`) and its network log
(`--log-net-log`): no driver, no download. The network log also holds the browser's own
background requests (updates, time sync); the page's requests are told apart by their network
isolation key, which is the page's site, `file://`. A control page that does load things checks
that this detection works. Host names resolve to nothing, so no request would leave anyway.

Regenerate the README's picture with `AMPSCOPE_UPDATE_SCREENSHOT=1 pytest
tests/test_report_browser.py` and look at it before committing it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import gpt2_tiny_report

SCREENSHOT = Path(__file__).parent.parent / "docs" / "img" / "report.png"
BF16_EDGE = (0x00, 0x83, 0x8F)  # render/plots.py DTYPE_COLORS["bfloat16"]


def find_chromium() -> str | None:
    named = os.environ.get("AMPSCOPE_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


BROWSER = find_chromium()
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium found (apt-get install chromium, or set AMPSCOPE_CHROMIUM)")


def chromium(page: Path, *args: str) -> str:
    """Open `page` in headless Chromium with `args`; its stdout. The profile is a fresh folder,
    and `--no-sandbox` lets it run as root (CI containers)."""
    profile = page.parent / f"profile-{page.stem}-{len(list(page.parent.iterdir()))}"
    result = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--user-data-dir={profile}", *args, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True)
    return result.stdout


def page_requests(page: Path) -> list[str]:
    """The URLs the page itself asked the network for while it loaded."""
    log = page.with_suffix(".netlog.json")
    chromium(page, f"--log-net-log={log}", "--dump-dom")
    data = json.loads(log.read_text())
    start_job = data["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [e["params"]["url"] for e in data["events"]
            if e["type"] == start_job and "url" in e.get("params", {})
            and str(e["params"].get("network_isolation_key", "")).startswith("file://")]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(gpt2_tiny_report()["html"])
    return path


def test_the_request_check_sees_a_page_that_loads(tmp_path):
    control = tmp_path / "control.html"
    control.write_text('<!DOCTYPE html><link rel="stylesheet" href="https://ampscope.invalid/a.css">'
                       '<img src="http://ampscope.invalid/x.png">')
    assert sorted(page_requests(control)) == ["http://ampscope.invalid/x.png",
                                              "https://ampscope.invalid/a.css"]


def test_report_makes_no_request_and_renders_its_sections(report):
    assert page_requests(report) == []
    dom = chromium(report, "--dump-dom")
    for key in ("findings", "flow", "matrix", "memory", "flops", "numerics"):
        assert f'<section id="{key}">' in dom
    assert dom.count("<svg") >= 11
    assert "<details" in dom


def test_report_screenshot_shows_the_flow_graph(report):
    from PIL import Image

    shot = report.with_suffix(".png")
    chromium(report, f"--screenshot={shot}", "--window-size=1400,2200")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2200)
    colours = image.getcolors(maxcolors=1 << 20)
    # The bf16 edges of the amp setting's graph are drawn: the SVG rendered.
    assert sum(n for n, c in colours if c == BF16_EDGE) > 200
    assert len(colours) > 50  # not a blank or error page
    if os.environ.get("AMPSCOPE_UPDATE_SCREENSHOT"):
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
