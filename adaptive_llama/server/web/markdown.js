// Markdown to DOM nodes, for model replies. Every piece of the model's text becomes a text
// node (textContent): no HTML is ever parsed from it, so a reply holding <script> or an
// onerror attribute shows as those characters. Links keep only http(s) and mailto targets.
//
// Blocks: fenced code (``` or ~~~, with its language shown), headings (#), lists (-, *, +,
// 1.), block quotes (>), rules (---), tables (| a | b |), display math ($$ ... $$ or
// \[ ... \]) and paragraphs. Inline: `code`, **bold**, *italic* and _italic_, ~~struck~~,
// math ($...$ or \(...\); a $ before a digit is money, not math), [links](https://...) and
// bare https:// links. Code and math show as written until typeset.js has them typeset.

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const TABLE_ROW = /^\s*\|.*\|\s*$/;
const TABLE_RULE = /^\s*\|?(\s*:?-{1,}:?\s*\|)+\s*:?-*:?\s*\|?\s*$/;
const SAFE_LINK = /^(https?:\/\/|mailto:)/i;
const DISPLAY_MATH = /^\s{0,3}(\$\$|\\\[)/;

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Inline markup of one line or paragraph, appended to `parent` as nodes.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([\s\S]*?[^\s*])\*|\b_(?=\S)([\s\S]*?\S)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"])|\$\$([^$]+?)\$\$|\\\(([\s\S]+?)\\\)|\$(?=[^\s$])([^$\n]*?[^\s$\\])\$(?!\d)/g;

export function renderInline(text, parent) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    last = match.index + match[0].length;
    const [, ticks, code, bold, struck, star, under, label, href, bare, shown, paren, dollar] =
      match;
    if (ticks) parent.append(el("code", "", code.replace(/^ (.*) $/s, "$1")));
    else if (bold !== undefined) renderInline(bold, parent.appendChild(el("strong")));
    else if (struck !== undefined) renderInline(struck, parent.appendChild(el("del")));
    else if (star !== undefined || under !== undefined) {
      renderInline(star ?? under, parent.appendChild(el("em")));
    } else if (label !== undefined) parent.append(link(label, href));
    else if (bare !== undefined) parent.append(link(bare, bare));
    else parent.append(formula(shown ?? paren ?? dollar, shown !== undefined, match[0]));
  }
  if (last < text.length) parent.append(text.slice(last));
  return parent;
}

function link(label, href) {
  if (!SAFE_LINK.test(href)) return document.createTextNode(`[${label}](${href})`);
  const a = el("a", "", label);
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}

// A formula, shown as written (`source`) until it is typeset.
function formula(tex, display, source) {
  const node = el(display ? "div" : "span", display ? "math display" : "math", source);
  node.dataset.tex = tex.trim();
  return node;
}

// Display math from line `i`: {node, next}, or null when the line only starts inline math
// ($$a$$ and more text). A formula still streaming (no closing yet) runs to the end.
function displayMath(lines, i) {
  const first = lines[i].trim();
  const close = first.startsWith("$$") ? "$$" : "\\]";
  const body = [first.slice(2)];
  if (body[0].includes(close) && !body[0].trimEnd().endsWith(close)) return null;
  for (let j = i; j < lines.length; j += 1) {
    if (j > i) body.push(lines[j]);
    const text = body.join("\n").trimEnd();
    if (text.endsWith(close)) {
      return { node: formula(text.slice(0, -2), true, `${first.slice(0, 2)}${text}`), next: j + 1 };
    }
  }
  return { node: formula(body.join("\n"), true, lines.slice(i).join("\n")), next: lines.length };
}

function codeBlock(language, lines) {
  const figure = el("div", "code-block");
  const bar = figure.appendChild(el("div", "code-bar"));
  bar.append(el("span", "code-language", language || "text"));
  const copy = bar.appendChild(el("button", "copy-code", "Copy"));
  copy.type = "button";
  const pre = figure.appendChild(el("pre"));
  const code = pre.appendChild(el("code", language ? `language-${language}` : "",
    lines.join("\n")));
  if (language) code.dataset.language = language;
  return figure;
}

function table(rows) {
  const cells = (row) => row.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
  const node = el("table");
  const head = node.appendChild(el("thead")).appendChild(el("tr"));
  for (const cell of cells(rows[0])) renderInline(cell, head.appendChild(el("th")));
  const body = node.appendChild(el("tbody"));
  for (const row of rows.slice(2)) {
    const tr = body.appendChild(el("tr"));
    for (const cell of cells(row)) renderInline(cell, tr.appendChild(el("td")));
  }
  const wrap = el("div", "table-wrap");
  wrap.append(node);
  return wrap;
}

// A list from consecutive bullet lines; deeper indentation nests.
function list(items) {
  const root = { indent: -1, node: null, children: [] };
  const stack = [root];
  for (const item of items) {
    while (stack.length > 1 && item.indent <= stack[stack.length - 1].indent) stack.pop();
    const entry = { ...item, children: [] };
    stack[stack.length - 1].children.push(entry);
    stack.push(entry);
  }
  const build = (entries) => {
    const ordered = /\d/.test(entries[0].marker);
    const node = el(ordered ? "ol" : "ul");
    if (ordered) node.start = parseInt(entries[0].marker, 10);
    for (const entry of entries) {
      const li = renderInline(entry.text, node.appendChild(el("li")));
      if (entry.children.length) li.append(build(entry.children));
    }
    return node;
  };
  return build(root.children);
}

export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      const closing = new RegExp(`^\\s{0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
      for (i += 1; i < lines.length && !closing.test(lines[i]); i += 1) body.push(lines[i]);
      out.append(codeBlock(fence[2], body));
      i += 1;  // the closing fence (or the end: a block still streaming)
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const heading = line.match(HEADING);
    if (heading) {
      out.append(renderInline(heading[2], el(`h${heading[1].length}`)));
      i += 1;
      continue;
    }
    if (RULE.test(line)) { out.append(el("hr")); i += 1; continue; }
    const math = DISPLAY_MATH.test(line) && displayMath(lines, i);
    if (math) {
      out.append(math.node);
      i = math.next;
      continue;
    }
    if (TABLE_ROW.test(line) && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const rows = [];
      while (i < lines.length && TABLE_ROW.test(lines[i])) rows.push(lines[i++]);
      out.append(table(rows));
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].match(QUOTE)[1]);
      const block = el("blockquote");
      block.append(renderMarkdown(quoted.join("\n")));
      out.append(block);
      continue;
    }
    if (BULLET.test(line)) {
      const items = [];
      while (i < lines.length && BULLET.test(lines[i])) {
        const [, indent, marker, itemText] = lines[i++].match(BULLET);
        items.push({ indent: indent.length, marker, text: itemText });
        // Lines that continue an item (indented, not a new bullet) join its text.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !BULLET.test(lines[i])) {
          items[items.length - 1].text += ` ${lines[i++].trim()}`;
        }
      }
      out.append(list(items));
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i])
           && !HEADING.test(lines[i]) && !BULLET.test(lines[i]) && !QUOTE.test(lines[i])
           && !(paragraph.length && DISPLAY_MATH.test(lines[i]))) {
      paragraph.push(lines[i++]);
    }
    const p = el("p");
    paragraph.forEach((part, n) => {
      if (n) p.append(el("br"));
      renderInline(part, p);
    });
    out.append(p);
  }
  return out;
}
