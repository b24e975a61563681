"""The HTML report's inline style sheet and script (no external resource: the page works from a file, offline)."""

# Token colours: class b0 (|Δ| = 0) to b8 (the run's largest |Δ|), white to deep orange; html_report.py bins.
NUM_BINS = 8
BIN_COLOURS = ("#ffffff", "#fff3e0", "#ffe0b2", "#ffcc80", "#ffb74d", "#ffa726", "#fb8c00", "#ef6c00", "#e65100")

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 0 0 0; color: #222; }
main { max-width: 1100px; margin: 0 auto; padding: 16px 24px 240px 24px; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 6px 0; }
code, pre, .toks, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; }
table { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } tr.differs td { font-weight: 600; background: #fff8e1; }
ul.glance li { margin: 3px 0; } pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; }
img.plot { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
.toks { white-space: pre-wrap; word-break: break-word; line-height: 1.9; font-size: 13px;
        border: 1px solid #eee; padding: 8px; }
.t { cursor: pointer; border-radius: 2px; padding: 1px 0; }
.t:hover, .t.sel { outline: 2px solid #1565c0; }
.t.flip { box-shadow: inset 0 -3px 0 #c62828; }
.t.empty { color: #999; font-size: 11px; }
.legend span.sw { display: inline-block; width: 26px; height: 14px; border: 1px solid #ccc; vertical-align: middle; }
.legend { font-size: 12px; margin: 6px 0; }
#detail { position: fixed; right: 12px; bottom: 12px; width: 430px; max-height: 70vh; overflow-y: auto;
          background: #fff; border: 1px solid #999; box-shadow: 0 2px 10px rgba(0,0,0,.2); padding: 8px 10px;
          font-size: 12px; display: none; }
#detail.on { display: block; } #detail table { width: 100%; } #detail .close { float: right; cursor: pointer; }
#detail td.hl { background: #e3f2fd; font-weight: 600; }
.note { color: #666; font-size: 12px; }
""" + "".join(f".b{i} {{ background: {c}; }}\n" for i, c in enumerate(BIN_COLOURS))

# The token panel. Reads the data block (a JSON array per token, see html_report.token_rows) and writes every
# value with textContent: token text from the run never becomes markup.
JS = """
(function () {
  const data = JSON.parse(document.getElementById("diff-data").textContent);
  const texts = data.texts, tokens = data.tokens, reqs = data.requests;
  const panel = document.getElementById("detail");
  let pinned = null;
  function shown(id) {  // as the console shows a token: its text quoted, "[id]" without a tokenizer
    const t = texts[String(id)];
    return t === undefined || t === null ? "[" + id + "]" : JSON.stringify(t);
  }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function row(table, cells, marked) {  // marked: indices of the cells to highlight
    const tr = el("tr");
    cells.forEach(function (c, j) {
      tr.appendChild(el(table.rows.length ? "td" : "th", c, marked && marked.includes(j) ? "hl" : null));
    });
    table.appendChild(tr);
  }
  function fmt(x) { return x === null || x === undefined ? "\\u2013" : Number(x).toPrecision(6); }
  function show(i) {
    const t = tokens[i];  // [request, position, token, logprob_a, logprob_b, rank_a, rank_b, kl, top_a, top_b]
    panel.replaceChildren();
    const close = el("span", "\\u2715", "close");
    close.onclick = function () { unpin(); panel.classList.remove("on"); };
    panel.appendChild(close);
    panel.appendChild(el("div", "request " + JSON.stringify(reqs[t[0]]) + ", position " + t[1]));
    panel.appendChild(el("div", "trace token " + shown(t[2]) + " (id " + t[2] + ")", "mono"));
    const s = el("table");
    row(s, ["", "A", "B"]);
    row(s, ["logprob", fmt(t[3]), fmt(t[4])]);
    row(s, ["rank", t[5] === null ? "\\u2013" : t[5], t[6] === null ? "\\u2013" : t[6]]);
    const top1 = [t[8], t[9]].map(function (k) {
      return k.length ? shown(k[0][0]) + " (" + k[0][0] + ")" : "\\u2013";
    });
    row(s, ["top-1", top1[0], top1[1]]);
    panel.appendChild(s);
    panel.appendChild(el("div", "\\u0394 = B \\u2212 A = " + fmt(t[4] - t[3]) + "   KL(A\\u2016B) = " + fmt(t[7])));
    const k = Math.max(t[8].length, t[9].length);
    if (k) {
      const tk = el("table");
      row(tk, ["#", "A top-k", "logprob", "B top-k", "logprob"]);
      for (let j = 0; j < k; j++) {
        const a = t[8][j], b = t[9][j];
        const marked = [].concat(a && a[0] === t[2] ? [1, 2] : [], b && b[0] === t[2] ? [3, 4] : []);
        row(tk, [j + 1, a ? shown(a[0]) + " (" + a[0] + ")" : "", a ? fmt(a[1]) : "",
                 b ? shown(b[0]) + " (" + b[0] + ")" : "", b ? fmt(b[1]) : ""], marked);
      }
      panel.appendChild(tk);
      panel.appendChild(el("div", "highlighted: the trace token in each side's top-k", "note"));
    }
    panel.classList.add("on");
  }
  function unpin() { if (pinned) pinned.classList.remove("sel"); pinned = null; }
  function pin(span) { unpin(); pinned = span; span.classList.add("sel"); show(Number(span.dataset.i)); }
  document.querySelectorAll(".t").forEach(function (span) {
    span.addEventListener("mouseenter", function () { if (!pinned) show(Number(span.dataset.i)); });
    span.addEventListener("click", function () { if (pinned === span) unpin(); else pin(span); });
  });
  const m = /^#t([0-9]+)$/.exec(location.hash);  // report.html#t12 opens with token 12 pinned
  const start = m && document.querySelector('.t[data-i="' + m[1] + '"]');
  if (start) {
    pin(start);
    const box = start.getBoundingClientRect();
    if (box.top < 0 || box.bottom > window.innerHeight) start.scrollIntoView({block: "center"});
  }
})();
"""
