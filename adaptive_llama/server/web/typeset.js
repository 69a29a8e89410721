// Code blocks highlighted and formulas typeset by the server (POST /web/typeset, Pygments
// and latex2mathml), so that no highlighter or math library ships to the browser: MathML is
// drawn by the browser itself. Each block and formula is asked for once; what is asked in
// one task goes in one request, and the answers are kept, so that drawing a chat again asks
// nothing. The answers are plain data: the text stays text, and a formula's MathML is built
// element by element. What the server cannot typeset stays as the model wrote it.

import { el } from "./markdown.js";

const MATHML = "http://www.w3.org/1998/Math/MathML";
const answers = new Map();  // what was asked (as JSON) -> its answer (null: keep as written)
let queued = [];
let api = null;

export function useApi(given) {
  api = given;
}

// The code blocks and formulas under `root` typeset, soon (they show as written till then).
export function typeset(root) {
  const found = [...root.querySelectorAll("code[data-language]:not([data-typeset]), "
    + ".math:not([data-typeset])")];
  for (const node of found) node.dataset.typeset = "asked";
  if (!found.length || !api) return;
  if (!queued.length) queueMicrotask(flush);
  queued.push(...found);
}

function question(node) {
  return node.matches(".math")
    ? { kind: "math", tex: node.dataset.tex, display: node.classList.contains("display") }
    : { kind: "code", language: node.dataset.language, text: node.textContent };
}

async function flush() {
  const asked = queued.map((node) => ({ node, question: question(node) }));
  queued = [];
  const missing = new Map();  // key -> question, each asked once
  for (const item of asked) {
    item.key = JSON.stringify(item.question);
    if (!answers.has(item.key)) missing.set(item.key, item.question);
  }
  if (missing.size) {
    try {
      await ask([...missing]);
    } catch (error) {
      console.warn(`Code and math stay as written: ${error.message}`);
      return;
    }
  }
  for (const { node, question: q, key } of asked) {
    const answer = answers.get(key);
    if (answer && node.isConnected) (q.kind === "math" ? showMath : showCode)(node, answer);
  }
}

// Asks the server for [key, question] pairs, and keeps its answers under their keys.
async function ask(pairs) {
  const code = pairs.filter(([, q]) => q.kind === "code");
  const math = pairs.filter(([, q]) => q.kind === "math");
  const answer = await api.json("/web/typeset", {
    method: "POST",
    body: JSON.stringify({
      code: code.map(([, q]) => ({ language: q.language, text: q.text })),
      math: math.map(([, q]) => ({ tex: q.tex, display: q.display })),
    }),
  });
  code.forEach(([key], i) => answers.set(key, answer.code[i]));
  math.forEach(([key], i) => answers.set(key, answer.math[i]));
}

// A code block as coloured pieces; left as it is unless the pieces are its text exactly.
function showCode(code, pieces) {
  if (pieces.map(([, text]) => text).join("") !== code.textContent) return;
  code.replaceChildren(...pieces.map(([kind, text]) => (kind ? el("span", `hl-${kind}`, text)
    : text)));
  code.dataset.typeset = "done";
}

function showMath(node, tree) {
  node.replaceChildren(mathElement(tree));
  node.dataset.typeset = "done";
}

// [tag, attributes, children...] as MathML elements; no attribute that could run anything.
function mathElement([tag, attributes, ...children]) {
  const node = document.createElementNS(MATHML, tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (/^[a-z]+$/.test(name) && !name.startsWith("on")) node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(typeof child === "string" ? child : mathElement(child));
  }
  return node;
}
