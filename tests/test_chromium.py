"""The browser helper that the explorer's tests drive (tests/chromium.py): its click lands on what a
reader sees, also on an inline element that wraps across two lines."""

from __future__ import annotations

import os
import urllib.parse

import pytest


@pytest.fixture(scope="module")
def page():
    from chromium import HeadlessChromium, find_chromium

    if find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: .ci/run installs the Debian package chromium")
        pytest.skip("no chromium binary here (apt-get install chromium, or set $NLA_CHROMIUM); CI runs this test")
    with HeadlessChromium(width=400, height=300) as p:
        yield p


# A 200 px line of monospace text (about 20 characters) in pre-wrap, as the explorer shows tokens:
# 19 x's, then a span whose leading space ends the first line and whose word starts the second. Its
# two boxes lie at opposite ends of the lines, so the centre of their union hits neither (the
# explorer's token " left" at a line end, docs/explore.png).
HTML = """<!doctype html><html><body style="margin:0">
<div style="width:200px;font:16px monospace;line-height:30px;white-space:pre-wrap">xxxxxxxxxxxxxxxxxxx<span
 id="wrap" onclick="window.clicked = (window.clicked || 0) + 1"> left</span> more words here</div>
<script>window.clicked = 0</script></body></html>"""


@pytest.mark.browser
def test_click_lands_on_a_wrapped_inline_element(page):
    page.goto("data:text/html," + urllib.parse.quote(HTML))
    page.wait_for("document.getElementById('wrap') !== null")
    boxes = page.evaluate("document.getElementById('wrap').getClientRects().length")
    assert boxes == 2, f"the fixture must wrap the span over two lines, found {boxes} box(es)"
    # the union's centre hits no part of the span: a click there would be lost
    hit = page.evaluate("(() => { const r = document.getElementById('wrap').getBoundingClientRect();"
                        " const e = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);"
                        " return e ? e.id : null; })()")
    assert hit != "wrap"
    page.click("#wrap")
    assert page.wait_for("window.clicked", timeout=10) == 1
