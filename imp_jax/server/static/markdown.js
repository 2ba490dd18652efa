/* A small Markdown renderer for model replies: headings, emphasis, lists, quotes, links, inline code and
   fenced code blocks with a keyword highlighter. Every piece of the source is HTML-escaped before it is
   placed, so a reply's own HTML shows as text; links keep only http(s), mailto and relative targets. */
(function () {
  "use strict";
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

  const KEYWORDS = new Set((
    "if else elif for while do return break continue switch case default try catch except finally throw raise " +
    "def class function fn func let const var import from export as with yield await async lambda new delete " +
    "in of is not and or pass struct enum impl trait pub use mod match where type interface extends implements " +
    "public private protected static final void int float double char bool boolean string str long short " +
    "unsigned signed auto package go defer select chan map range true false True False None null nil undefined " +
    "this self super echo fi then done esac local global nonlocal assert"
  ).split(" "));
  const HASH_COMMENTS = new Set(["py", "python", "sh", "bash", "shell", "zsh", "console", "yaml", "yml", "toml",
    "ruby", "rb", "r", "perl", "pl", "dockerfile", "makefile", "make", "ini", "conf", "nim", "julia", "jl"]);
  const PLAIN = new Set(["", "text", "txt", "plain", "plaintext", "output", "log", "markdown", "md"]);
  const STR = "\"(?:\\\\.|[^\"\\\\\\n])*\"|'(?:\\\\.|[^'\\\\\\n])*'|`(?:\\\\.|[^`\\\\])*`";
  const NUM = "\\b\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?\\b|\\b0x[\\da-fA-F]+\\b";
  const WORD = "\\b[A-Za-z_$][\\w$]*\\b";
  const TOKEN_HASH = new RegExp(`(#[^\\n]*|"""[\\s\\S]*?"""|${STR}|${NUM}|${WORD})`, "g");
  const TOKEN_C = new RegExp(`(\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?\\*\\/|${STR}|${NUM}|${WORD})`, "g");

  /** Code as HTML: comments, strings, numbers and keywords in spans; everything escaped. */
  function highlight(code, lang) {
    lang = String(lang || "").toLowerCase();
    if (PLAIN.has(lang)) return esc(code);
    const re = HASH_COMMENTS.has(lang) ? TOKEN_HASH : TOKEN_C;
    re.lastIndex = 0;
    let out = "", last = 0, m;
    while ((m = re.exec(code)) !== null) {
      const t = m[0];
      out += esc(code.slice(last, m.index));
      let cls = null;
      if (t[0] === "#" || t.startsWith("//") || t.startsWith("/*")) cls = "c";
      else if (t[0] === '"' || t[0] === "'" || t[0] === "`") cls = "s";
      else if (/^\d/.test(t)) cls = "n";
      else if (KEYWORDS.has(t)) cls = "k";
      out += cls ? `<span class="tok-${cls}">${esc(t)}</span>` : esc(t);
      last = m.index + t.length;
    }
    return out + esc(code.slice(last));
  }

  function safeUrl(url) {
    const u = url.trim();
    return /^(https?:\/\/|mailto:|\/|#|\.\.?\/)/i.test(u) ? u : null;
  }

  /** One line (or paragraph) of inline Markdown as HTML. */
  function inline(text) {
    const codes = [];
    let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
    const links = [];
    s = s.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (whole, label, url) => {
      const safe = safeUrl(url);
      if (safe === null) return whole;
      links.push([label, safe]);
      return `\u0001${links.length - 1}\u0001`;
    });
    s = emphasis(esc(s));
    s = s.replace(/\u0001(\d+)\u0001/g, (_, i) => {
      const [label, url] = links[+i];
      return `<a href="${esc(url)}" target="_blank" rel="noopener noreferrer">${emphasis(esc(label))}</a>`;
    });
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${esc(codes[+i])}</code>`);
  }

  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])?\*(?!\*)/g, (m, pre, body) =>
        body === undefined ? m : `${pre}<em>${body}</em>`)
      .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([^~\n]*?\S)~~/g, "<del>$1</del>");
  }

  const TABLE_RULE = /^(?=.*\|)\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const cells = (row) => row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());

  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

  function list(lines, start) {
    const first = ITEM.exec(lines[start]);
    const indent = first[1].length, ordered = /\d/.test(first[2]);
    const items = [];
    let i = start, cur = null;
    while (i < lines.length) {
      const line = lines[i], m = ITEM.exec(line);
      if (m && m[1].length >= indent && m[1].length <= indent + 1) {
        if (/\d/.test(m[2]) !== ordered) break;
        cur = [m[3]];
        items.push(cur);
      } else if (m && m[1].length < indent) {
        break;
      } else if (!line.trim()) {
        const next = lines[i + 1] || "";
        if (!(/^\s+\S/.test(next) || ITEM.test(next))) break;
        cur.push("");
      } else if (/^\s+\S/.test(line)) {
        cur.push(line.slice(Math.min(indent + 2, line.search(/\S/))));
      } else {
        cur.push(line);   // a lazy continuation of the item's paragraph
      }
      i++;
    }
    const tag = ordered ? "ol" : "ul";
    const n = ordered ? parseInt(first[2], 10) : 1;
    const body = items.map((it) => "<li>" + (it.length === 1 ? inline(it[0])
      : render(it.join("\n")).replace(/^<p>([\s\S]*?)<\/p>/, "$1")) + "</li>").join("");
    return [`<${tag}${ordered && n !== 1 ? ` start="${n}"` : ""}>${body}</${tag}>`, i];
  }

  /** Markdown source as HTML. An unclosed code fence (a reply still streaming) runs to the end. */
  function render(src) {
    const lines = String(src).replace(/\r\n?/g, "\n").replace(/[\u0000\u0001]/g, "").split("\n");
    let html = "", para = [], i = 0, m;
    const flush = () => {
      if (para.length) html += "<p>" + inline(para.join("\n")).replace(/\n/g, "<br>") + "</p>";
      para = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      if ((m = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/.exec(line))) {
        flush();
        const fence = m[1], lang = m[2], body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
        i++;
        html += `<div class="code-block"><div class="code-head"><span>${esc(lang || "text")}</span>` +
          `<button type="button" class="copy-code">Copy</button></div><pre><code>` +
          `${highlight(body.join("\n"), lang)}</code></pre></div>`;
      } else if ((m = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/.exec(line))) {
        flush();
        html += `<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`;
        i++;
      } else if (/^ {0,3}([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        html += "<hr>";
        i++;
      } else if (line.includes("|") && TABLE_RULE.test(lines[i + 1] || "")) {
        flush();
        const head = cells(line), rows = [];
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) rows.push(cells(lines[i]));
        html += "<table><thead><tr>" + head.map((c) => `<th>${inline(c)}</th>`).join("") + "</tr></thead><tbody>" +
          rows.map((r) => "<tr>" + head.map((_, k) => `<td>${inline(r[k] || "")}</td>`).join("") + "</tr>").join("") +
          "</tbody></table>";
      } else if (/^ {0,3}>/.test(line)) {
        flush();
        const quote = [];
        while (i < lines.length && /^ {0,3}>/.test(lines[i])) quote.push(lines[i++].replace(/^ {0,3}> ?/, ""));
        html += `<blockquote>${render(quote.join("\n"))}</blockquote>`;
      } else if (ITEM.test(line) && !(para.length && /^\s/.test(line))) {
        flush();
        const [part, next] = list(lines, i);
        html += part;
        i = next;
      } else if (!line.trim()) {
        flush();
        i++;
      } else {
        para.push(line);
        i++;
      }
    }
    flush();
    return html;
  }

  window.ImpMarkdown = { render, highlight, escape: esc };
})();
