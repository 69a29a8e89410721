// Compare: the same turn made again with another sampler and the same seed, both replies
// as coloured tokens side by side, the first token where they part marked. The sampler is
// picked from the server's list (or typed with its parameters). A comparison is kept with
// its reply, so that it is still there after a reload.

import { el } from "./markdown.js";
import { $, persist, spec, state } from "./page.js";
import { firstDifference, renderTokens } from "./tokens.js";

// What compare needs from the conversation: set by app.js (stream, requestBody,
// setRunning, seedOf, freshSeed, showError).
let talk = null;

export function setupCompare(conversation) {
  talk = conversation;
  $("compare-run").addEventListener("click", runCompare);
  $("compare-cancel").addEventListener("click", () => $("compare-dialog").close());
  $("compare-spec").addEventListener("keydown", (event) => {
    if (event.key === "Enter") runCompare();
  });
}

// The samplers of the server's table, for the spec field's list.
export function listSamplers() {
  const names = state.table.filter((s) => !s.modifier).map((s) => s.name);
  $("compare-samplers").replaceChildren(...names.map((name) => {
    const option = document.createElement("option");
    option.value = name;
    return option;
  }));
}

export function openCompare(index) {
  if (state.running) return;
  const message = state.chat.messages[index];
  const current = samplerOf(message);
  $("compare-a").textContent = current;
  $("compare-spec").value = message.comparison?.spec
    ?? (current.startsWith("greedy") ? "adaptive" : "greedy");
  $("compare-dialog").dataset.index = index;
  $("compare-dialog").showModal();
  $("compare-spec").focus();
}

function samplerOf(message) {
  return message.stats?.sampler || message.spec || spec();
}

// Two columns of tokens and the line under them; `left`/`right`: their contents.
function panelFor(node, leftTitle, rightTitle) {
  node.querySelector(".comparison")?.remove();
  const panel = node.appendChild(el("div", "comparison"));
  const columns = panel.appendChild(el("div", "columns"));
  const column = (title) => {
    const holder = columns.appendChild(el("div", "column"));
    holder.append(el("div", "column-title", title));
    return holder.appendChild(el("div", "content token-view"));
  };
  const left = column(leftTitle);
  const right = column(rightTitle);
  return { left, right, verdict: panel.appendChild(el("div", "verdict", "Comparing…")) };
}

async function runCompare() {
  const dialog = $("compare-dialog");
  dialog.close();
  const index = Number(dialog.dataset.index);
  const original = state.chat.messages[index];
  const other = $("compare-spec").value.trim();
  const known = talk.seedOf(original);  // none for a reply imported without one
  const seed = known ?? talk.freshSeed();
  const history = state.chat.messages.slice(0, index);
  const node = $("messages").querySelector(`.message[data-index="${index}"]`);
  const { left, right, verdict } = panelFor(node, `${samplerOf(original)} · seed ${seed}`,
    `${other} · seed ${seed}`);
  const controller = new AbortController();
  talk.setRunning(controller);
  talk.showError("");
  const viewWas = state.settings.tokenView;
  state.settings.tokenView = true;  // both sides as tokens, for the mark where they part
  try {
    let a = original;
    if (!original.details || known == null) {  // made again, same sampler, this seed
      a = { role: "assistant", content: "", details: [] };
      left.details = a.details;
      await talk.stream(talk.requestBody(history, original.spec || spec(), seed), a, left,
        controller);
    } else {
      left.details = original.details;
      renderTokens(left, original.details);
    }
    const b = { role: "assistant", content: "", details: [] };
    right.details = b.details;
    await talk.stream(talk.requestBody(history, other, seed), b, right, controller);
    markDifference(a.details, b.details, left, right, verdict);
    original.comparison = { spec: other, seed, sampler: samplerOf(original),
      details: b.details, ...(a === original ? {} : { left: a.details }) };
    persist();
  } catch (error) {
    talk.showError(error.message);
    verdict.textContent = "The comparison failed.";
  } finally {
    state.settings.tokenView = viewWas;
    talk.setRunning(null);
  }
}

// A kept comparison, drawn again under its reply (`node`).
export function showComparison(node, message) {
  const kept = message.comparison;
  const { left, right, verdict } = panelFor(node, `${kept.sampler} · seed ${kept.seed}`,
    `${kept.spec} · seed ${kept.seed}`);
  left.details = kept.left || message.details || [];
  right.details = kept.details;
  renderTokens(left, left.details);
  renderTokens(right, right.details);
  markDifference(left.details, right.details, left, right, verdict);
}

function markDifference(a, b, left, right, verdict) {
  const at = firstDifference(a.map((d) => d.text), b.map((d) => d.text));
  if (at < 0) {
    verdict.textContent = "Same text, token for token.";
    return;
  }
  for (const side of [left, right]) side.querySelector(`.tok[data-i="${at}"]`)?.classList.add("diverge");
  verdict.textContent = `They part at token ${at + 1}.`;
  verdict.dataset.at = at;
}
