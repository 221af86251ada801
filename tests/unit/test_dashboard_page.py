"""The dashboard's page is plain files that keep to its Content-Security-Policy: no inline code,
nothing from elsewhere, and no way for a value from the controller to become HTML."""

from __future__ import annotations

import os
import re

from services.dashboard import web

STATIC = web.STATIC_DIR


def read(name: str) -> str:
    with open(os.path.join(STATIC, name), encoding="utf-8") as fh:
        return fh.read()


def test_values_reach_the_page_as_text_never_as_html() -> None:
    js = read("app.js")
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        'setAttribute("on',
    ):
        assert sink not in js, sink
    # Links only for http(s) URLs, so a `javascript:` endpoint cannot run.
    assert 'parsed.protocol !== "http:" && parsed.protocol !== "https:"' in js


def test_no_inline_code_and_nothing_from_elsewhere() -> None:
    html = read("index.html")
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="app.js" defer>']
    assert "<style" not in html
    assert not re.search(r"<[^>]*\s(style|on[a-z]+)\s*=", html), "no inline styles or event handlers"
    for name in ("index.html", "app.js", "style.css"):
        text = read(name)
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), name
        assert "@import" not in text and "url(" not in text, name


def test_every_element_the_script_uses_is_on_the_page() -> None:
    ids = set(re.findall(r'\$\("([a-z-]+)"\)', read("app.js")))
    assert ids, "the script looks elements up by id"
    html = read("index.html")
    assert sorted(i for i in ids if f'id="{i}"' not in html) == []
