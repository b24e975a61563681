"""report.html of `replayllm diff`: one self-contained page (no external URL), token text escaped (no markup from
the run), every request's tokens rendered; in headless Chromium when the `chromium` package is installed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers.diff_samples import EVIL, synthetic_result

from replayllm.entrypoints.diff import DiffResult, TraceRecord, compare, write_report
from replayllm.entrypoints.diff.html_report import display_text, to_html
from replayllm.entrypoints.diff.results import LayerDiff, Localization

# Trace tokens of the embedded model's real tokenizer whose texts are markup and a URL's pieces:
# '<script', '>', '</', 'script', '>', ' https', '://', 'example'.
EVIL_TRACE = [7734, 29, 522, 2282, 29, 3703, 1110, 8687]
ENGINE = "device=cpu,max_model_len=128"


class _Page(HTMLParser):
    """What the tests read of a page: tags with attributes, script bodies, token spans per request section."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self.sections: dict[str, list[tuple[int, str]]] = {}  # data-request -> [(data-i, text), ...]
        self._script: list[str] | None = None
        self._span: tuple[int, list[str]] | None = None
        self._section: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script":
            self._script = []
        elif tag == "section" and "data-request" in a:
            self._section = a["data-request"]
            self.sections[self._section] = []
        elif tag == "span" and "data-i" in a and self._section is not None:
            self._span = (int(a["data-i"]), [])

    def handle_endtag(self, tag):
        if tag == "script" and self._script is not None:
            self.scripts.append("".join(self._script))
            self._script = None
        elif tag == "span" and self._span is not None:
            self.sections[self._section].append((self._span[0], "".join(self._span[1])))
            self._span = None
        elif tag == "section":
            self._section = None

    def handle_data(self, data):
        if self._script is not None:
            self._script.append(data)
        elif self._span is not None:
            self._span[1].append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def _assert_self_contained(text: str, page: _Page) -> None:
    assert not re.search(r"https?://", text), "an external URL in the page"
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            if name in attrs:
                assert attrs[name].startswith(("data:", "#")), (tag, name, attrs[name][:40])
        assert tag not in ("link", "iframe", "object", "embed"), tag
    # Exactly our two scripts: the data block and the panel's code; no token text became a tag.
    assert [a.get("type") for t, a in page.tags if t == "script"] == ["application/json", None]


def test_token_text_is_escaped_everywhere_and_the_page_is_self_contained():
    result = synthetic_result()
    text = to_html(result)
    page = _parse(text)
    _assert_self_contained(text, page)
    assert EVIL not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text  # shown as text in the token line and the tables
    # The data block is valid JSON that reads back the exact token texts and top-k.
    data = json.loads(page.scripts[0])
    assert data["texts"]["7"] == EVIL and data["texts"]["10"].startswith("</script>")
    assert data["requests"] == ["<b>r0</b>", "r1"]
    assert data["tokens"][4] == [1, 0, 10, -0.5, -0.7, 1, 2, 0.2, [[10, -0.5]], [[8, -0.6], [10, -0.7]]]
    # Every request's section shows its tokens, in order (an empty text as ⟨id⟩, no tokenizer as [id]).
    assert page.sections == {rid: [(i + (4 if rid == "r1" else 0), display_text(t.token, t.text))
                                   for i, t in enumerate(r.tokens)]
                             for rid, r in ((r.request_id, r) for r in result.requests)}
    assert display_text(9, "") == "\u27e89\u27e9" and display_text(11, None) == "[11]"
    # The one flip is marked, and it has the run's largest |Δ|: the darkest colour.
    assert 'class="t b8 flip" data-i="4"' in text and len(re.findall(r"class=\"t [^\"]*flip", text)) == 1


def test_the_layer_table_of_localize_names_the_first_jump():
    cps = [LayerDiff("embedding", None, "embedding", 0.0), LayerDiff("layer 0 mlp", 0, "mlp", 0.25),
           LayerDiff("logits", None, "logits", 0.3)]
    located = Localization([("<b>r0</b>", 1)], cps, cps[1], 10, 1e-3)
    result = dataclasses.replace(synthetic_result(), localization=located)
    text = to_html(result)
    _assert_self_contained(text, _parse(text))
    assert '<tr class="differs"><td>layer 0 mlp (first jump)</td><td>0.25</td></tr>' in text
    assert "&#x27;&lt;b&gt;r0&lt;/b&gt;&#x27;:1" in text  # the examined position, escaped


def test_write_report_writes_report_html_with_the_plots_inline(tmp_path):
    result = synthetic_result()
    files = write_report(result, tmp_path / "r")
    assert files.html == tmp_path / "r" / "report.html"
    text = files.html.read_text(encoding="utf-8")
    page = _parse(text)
    _assert_self_contained(text, page)
    images = [a["src"] for t, a in page.tags if t == "img"]
    assert len(images) == len(files.plots) == 2 and all(s.startswith("data:image/png;base64,iVBORw0KGgo")
                                                        for s in images)
    assert write_report(result, tmp_path / "n", plots=False, html=False).html is None
    assert not (tmp_path / "n" / "report.html").exists()


@pytest.fixture(scope="module")
def real_report(tmp_path_factory) -> tuple[DiffResult, Path]:
    """fp32 vs bf16 on the embedded model, one trace of markup tokens under a markup request id."""
    records = [TraceRecord(id="<i>evil</i>", prompt="Once upon a time", trace_token_ids=EVIL_TRACE),
               TraceRecord(id="plain", prompt="The capital of France is", trace_token_ids=[12095, 13, 576, 6722])]
    result = compare(records, f"dtype=float32,{ENGINE}", f"dtype=bfloat16,{ENGINE}", top_k=5)
    files = write_report(result, tmp_path_factory.mktemp("html") / "r")
    return result, files.html


def test_a_real_diff_renders_every_request_and_escapes_markup_tokens(real_report):
    result, path = real_report
    text = path.read_text(encoding="utf-8")
    page = _parse(text)
    _assert_self_contained(text, page)
    assert text.count("<script") == 2 and "<i>evil</i>" not in text
    _assert_tokens_rendered(result, page)
    data = json.loads(page.scripts[0])
    assert len(data["tokens"]) == result.overall.num_tokens
    assert all(len(row[8]) == len(row[9]) == 5 for row in data["tokens"])  # both sides' top-5 travel


def _assert_tokens_rendered(result: DiffResult, page: _Page) -> None:
    expected = {r.request_id: [display_text(t.token, t.text) for t in r.tokens] for r in result.requests}
    assert {rid: [s for _, s in spans] for rid, spans in page.sections.items()} == expected
    assert expected["<i>evil</i>"][:5] == ["<script", ">", "</", "script", ">"]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium package is not installed (.ci/run installs it; apt-get install -y "
                           "--no-install-recommends chromium)")
def test_headless_chromium_renders_every_request_and_the_token_panel(real_report, tmp_path):
    result, path = real_report
    flip_index = next((i for i, t in enumerate(result.tokens) if t.argmax_agree is False), 0)
    shot = tmp_path / "shot.png"
    # One browser run: the page with token flip_index pinned (#tN), screenshot + the DOM after the script ran.
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1400", f"--screenshot={shot}",
           "--dump-dom", f"{path.as_uri()}#t{flip_index}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    page = _parse(run.stdout)
    _assert_tokens_rendered(result, page)
    # The script ran: the panel shows the pinned token's request, position and both sides' logprob and rank.
    t = result.tokens[flip_index]
    panel = run.stdout[run.stdout.index('<div id="detail"'):]
    assert 'class="on"' in panel[:80]
    assert f"position {t.position}" in panel and f"{t.logprob_a:.6g}"[:6] in panel and f"{t.logprob_b:.6g}"[:6] in panel
    assert f"<td>rank</td><td>{t.rank_a}</td><td>{t.rank_b}</td>" in panel
    # A real picture: the window's size, and many colours (text, tables, the coloured tokens, the plots).
    data = shot.read_bytes()
    assert _png_size(data) == (1200, 1400) and len(data) > 20_000
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3].reshape(-1, 3)
    assert len({tuple(p) for p in pixels[:: 37].tolist()}) > 50
