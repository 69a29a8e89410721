// The chat page: the messages, the composer, replies and their branches, and the token
// card (the chats in chats.js, compare in compare.js, the settings panel in settings.js,
// the shared state in page.js).
// Model text reaches the page only through textContent (markdown.js builds nodes), never as
// HTML; the server's Content-Security-Policy forbids inline script and other origins.

import { Api, ApiError } from "./api.js";
import { readAttachment, retyped, withAttachments } from "./attach.js";
import { branchFrom, cutAt, putBack, showVersion } from "./branches.js";
import { listSamplers, openCompare, setupCompare, showComparison } from "./compare.js";
import { el } from "./markdown.js";
import { $, button, persist, showError, showNotice, spec, state } from "./page.js";
import { LiveReply, showMessage, showPlot, thinkingBlock } from "./reply.js";
import { buildSettings, showSettings, wireSettings } from "./settings.js";
import { currentChat, exportChat, importChat, OPEN_CHAT, openChat, renderChatList, selectChat,
  setupChats } from "./chats.js";
import { loadChats, titleOf } from "./store.js";
import { fillCard, kLegend } from "./tokens.js";
import { useApi } from "./typeset.js";


const api = new Api(askKey);
useApi(api);

// ---- small helpers ----

// A Copy button says "Copied" for a moment, then is a Copy button again.
function copied(button) {
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // Not a secure context (a page on a LAN address): the older way.
    const area = el("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

// ---- the API key (asked once per tab) ----

function askKey(wasWrong) {
  const dialog = $("key-dialog");
  $("key-note").textContent = wasWrong ? "That key was not accepted. Try again."
    : "This server needs its API key (serve --api-key). It is kept for this tab only.";
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    const done = (value) => {
      dialog.close();
      $("key-ok").onclick = $("key-cancel").onclick = $("key-input").onkeydown = null;
      resolve(value);
    };
    $("key-ok").onclick = () => done($("key-input").value.trim() || null);
    $("key-cancel").onclick = () => done(null);
    $("key-input").onkeydown = (event) => {
      if (event.key === "Enter") done($("key-input").value.trim() || null);
    };
  });
}

// ---- messages ----

function renderMessages() {
  const holder = $("messages");
  holder.replaceChildren();
  const messages = state.chat?.messages || [];
  if (!messages.length) holder.append(emptyNote());
  messages.forEach((message, i) => holder.append(messageNode(message, i)));
  holder.scrollTop = holder.scrollHeight;
}

function emptyNote() {
  const note = el("div", "empty");
  note.append(el("h2", "", "adaptive-llama"));
  note.append(el("p", "", "Adaptive decoding picks how many candidates to keep at every token. "
    + "Turn on Tokens to see its choice: each token coloured by its candidate-set size k, "
    + "its candidates on hover."));
  return note;
}

function messageNode(message, index) {
  const node = el("div", `message ${message.role}`);
  node.dataset.index = index;
  const content = node.appendChild(el("div", "content"));
  showMessage(content, message, state.settings.tokenView);
  if (message.files) {  // a question's attached files, by name
    const files = el("div", "files");
    files.append(...message.files.map((name) => fileChip(name)));
    content.after(files);
  }
  if (message.reasoning && !(state.settings.tokenView && message.details)) {
    content.before(thinkingBlock(message, false));
  }
  if (message.role === "assistant") {
    if (state.settings.tokenView && message.details?.length) node.append(kLegend());
    showPlot(node.appendChild(el("div", "plot")), message);
    node.append(metaLine(message));
  }
  node.append(actions(message, index));
  if (message.comparison) showComparison(node, message);
  return node;
}

// What a reply was made with and what it cost; a stopped reply (no stats came) still says
// its tokens, sampler and seed, which the page sent.
function metaLine(message) {
  const s = message.stats || {};
  const parts = [];
  const tokens = s.completion_tokens ?? message.details?.length;
  if (message.interrupted) parts.push("stopped");
  if (s.prompt_tokens != null) parts.push(promptFigures(s));
  if (tokens != null) parts.push(`${tokens} tokens`);
  if (s.decode_tokens_per_s) parts.push(`${s.decode_tokens_per_s.toFixed(1)} tok/s`);
  if (s.mean_k != null) parts.push(`mean k ${s.mean_k.toFixed(1)}`);
  if (s.sampler || message.spec) parts.push(s.sampler || message.spec);
  if (seedOf(message) != null) parts.push(`seed ${seedOf(message)}`);
  return el("div", "meta", parts.join(" · "));
}

// The prompt: its tokens, those the cache did not hold, and how long they took.
function promptFigures(s) {
  const fresh = s.prompt_evaluated ?? s.prompt_tokens;
  const rate = s.prompt_eval_s > 0 && fresh ? `, ${(fresh / s.prompt_eval_s).toFixed(0)} tok/s` : "";
  const cached = fresh < s.prompt_tokens ? ` (${s.prompt_tokens - fresh} cached)` : "";
  return `prompt ${s.prompt_tokens} tokens${cached} in ${s.prompt_eval_s.toFixed(2)} s${rate}`;
}

function seedOf(message) {
  return message.stats?.seed ?? message.seed;
}

// A seed of the page's own when the settings give none: every reply is sent with one, so
// that a stopped reply can be compared or made again.
function freshSeed() {
  return crypto.getRandomValues(new Uint32Array(1))[0];
}

function actions(message, index) {
  const bar = el("div", "actions");
  const messages = state.chat.messages;
  const last = index === messages.length - 1;
  if (message.role === "assistant") {
    bar.append(button("Copy", (event) => {
      copyText(message.content);
      copied(event.target);
    }, "copy"));
    bar.append(button("Regenerate", () => regenerate(index), "regenerate"));
    bar.append(button("Compare", () => openCompare(index), "compare"));
  } else if (message.role === "user") {
    bar.append(button("Edit", () => editMessage(index), "edit"));
    // A question whose reply failed (a bad setting, a stopped server): ask again.
    if (last) bar.append(button("Retry", () => reply(), "retry"));
  }
  if (message.versions) bar.append(versionNav(message, index));
  return bar;
}

let markIdle = () => {};
function setRunning(controller) {
  const stopFocused = document.activeElement === $("stop");
  state.running = controller;
  if (controller) state.idle = new Promise((resolve) => { markIdle = resolve; });
  else markIdle();
  $("send").hidden = Boolean(controller);
  $("stop").hidden = !controller;
  document.body.classList.toggle("running", Boolean(controller));
  // while a reply streams, screen readers wait for it whole rather than read each token
  $("messages").setAttribute("aria-busy", String(Boolean(controller)));
  // a reply's end leaves the focus where the next question is typed, not on <body>
  if (!controller && (stopFocused || document.activeElement === document.body)) {
    $("input").focus();
  }
}

// The request for a reply to `messages` (the chat's system prompt first).
function requestBody(messages, specText, seed) {
  const chat = currentChat();
  const system = chat.system ? [{ role: "system", content: chat.system }] : [];
  const body = {
    model: state.settings.model || undefined,
    messages: [...system, ...messages.map((m) => ({ role: m.role, content: m.content }))],
    sampler: specText, token_details: true, stream_options: { include_usage: true },
    max_tokens: Number(state.settings.maxTokens) || undefined,
  };
  if (seed !== "" && seed != null) body.seed = Number(seed);
  return body;
}

// Streams one reply into `message` (shown in `content`); returns once it has ended.
async function stream(body, message, content, controller) {
  const live = state.live = new LiveReply(content, message, state.settings.tokenView);
  try {
    for await (const chunk of api.chat(body, controller.signal)) {
      const choice = chunk.choices?.[0];
      live.add(choice?.delta?.content, chunk.token_details, choice?.delta?.reasoning_content);
      if (chunk.sampler_stats) message.stats = chunk.sampler_stats;
    }
  } catch (error) {
    if (error.name !== "AbortError") throw error;
    message.interrupted = true;
  } finally {
    state.live = null;
    live.finish();
  }
}

// A reply to the chat's last question; `replaced`: the reply it makes again, and what
// followed it (Regenerate), as branches.js's cutAt took them out.
async function reply(replaced = null) {
  const chat = currentChat();
  chat.model = state.settings.model;
  const given = state.settings.seed;
  const seed = given === "" || given == null ? freshSeed() : Number(given);
  const message = { role: "assistant", content: "", spec: spec(), seed };
  if (replaced) branchFrom(message, replaced);
  chat.messages.push(message);
  const index = chat.messages.length - 1;
  const node = messageNode(message, index);
  $("messages").querySelector(".empty")?.remove();
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  const controller = new AbortController();
  setRunning(controller);
  showError("");
  try {
    await stream(requestBody(chat.messages.slice(0, -1), message.spec, seed),
      message, node.querySelector(".content"), controller);
  } catch (error) {
    showError(error.message);
    if (message.content) message.interrupted = true;
    else {
      chat.messages.pop();  // nothing came: the question stays, ready for Retry,
      if (replaced) putBack(chat.messages, replaced);  // or the reply it was to replace
    }
  } finally {
    setRunning(null);
    chat.updated = Date.now();
    persist();
    renderMessages();
  }
}

// What is wrong with the seed or max tokens typed in Settings, in one line; null if nothing.
// Checked before sending: a bad value would otherwise be dropped without a word.
function settingsProblem() {
  const whole = (value) => /^\d+$/.test(String(value).trim());
  const given = (value) => value != null && String(value).trim() !== "";
  const { seed, maxTokens } = state.settings;
  if (given(seed) && !(whole(seed) && Number(seed) < 2 ** 32)) {
    return `seed has to be a whole number below 4294967296 (or empty for a random one), but is ${seed}`;
  }
  if (given(maxTokens) && !(whole(maxTokens) && Number(maxTokens) >= 1)) {
    return `max tokens has to be a whole number of 1 or more (or empty), but is ${maxTokens}`;
  }
  return null;
}

// A chip per attached file: its name, and × to take it off before sending.
function fileChip(name, remove) {
  const chip = el("span", "file-chip", name);
  if (remove) {
    const off = chip.appendChild(button("×", remove, "remove-file"));
    off.setAttribute("aria-label", `Remove ${name}`);
  }
  return chip;
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((file, i) => fileChip(file.name,
    () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    })));
}

async function attach(files) {
  for (const file of files) {
    try {
      state.attachments.push(await readAttachment(file, (name, data) => api.pdfText(name, data)));
    } catch (error) {
      showError(`Cannot attach ${error.message}`);
    }
  }
  renderAttachments();
}

function send() {
  const input = $("input");
  const text = input.value;
  const files = state.attachments;
  if ((!text.trim() && !files.length) || state.running) return;
  const problem = settingsProblem();
  if (problem) {  // the question stays in the box, to send once the setting is right
    showError(problem);
    return;
  }
  const chat = currentChat();
  const question = files.length ? { role: "user", content: withAttachments(text, files),
    typed: text, files: files.map((f) => f.name) } : { role: "user", content: text };
  const last = chat.messages.length - 1;
  if (chat.messages[last]?.role === "user") {
    // A question left unanswered (its reply was refused) gives way to the one sent now: the
    // model never gets two questions in a row. An edited one's earlier versions stay.
    const replaced = cutAt(chat.messages, last);
    chat.messages.push(replaced.previous.versions ? branchFrom(question, replaced) : question);
  } else {
    chat.messages.push(question);
  }
  if (chat.title === "New chat") chat.title = titleOf(chat.messages) || chat.title;
  state.attachments = [];
  renderAttachments();
  input.value = "";
  autosize();
  renderChatList();
  renderMessages();  // the question shows at once, above its reply as it streams
  reply();
}

// A reply made again; the one before, and what followed it, stay as its earlier version.
function regenerate(index) {
  if (state.running || state.chat.messages[index]?.role !== "assistant") return;
  const replaced = cutAt(state.chat.messages, index);
  renderMessages();
  reply(replaced);
}

// ---- branches: ‹ › at a message moves between its versions, each with what followed ----

function switchVersion(index, target) {
  const message = state.chat.messages[index];
  if (state.running || target < 0 || target >= message.versions.length) return;
  showVersion(state.chat.messages, index, target);
  persist();
  renderMessages();
}

function versionNav(message, index) {
  const nav = el("span", "versions");
  const back = nav.appendChild(button("‹", () => switchVersion(index, message.shown - 1),
    "earlier"));
  back.setAttribute("aria-label", "The version before");
  back.disabled = message.shown === 0;
  nav.append(el("span", "version-count", `${message.shown + 1}/${message.versions.length}`));
  const next = nav.appendChild(button("›", () => switchVersion(index, message.shown + 1),
    "later"));
  next.setAttribute("aria-label", "The version after");
  next.disabled = message.shown === message.versions.length - 1;
  return nav;
}

// A question edited in place and sent as a new version of it; the question before, with
// its reply and what followed, stays as the version before.
function editMessage(index) {
  if (state.running) return;
  const node = $("messages").querySelector(`.message[data-index="${index}"]`);
  const content = node.querySelector(".content");
  const area = el("textarea", "edit-area");
  const question = state.chat.messages[index];
  area.value = question.typed ?? question.content;
  area.setAttribute("aria-label", "The question, edited");
  content.replaceChildren(area);
  const bar = node.querySelector(".actions");
  bar.replaceChildren(
    button("Send", () => {
      if (!area.value.trim()) return;
      const replaced = cutAt(state.chat.messages, index);
      state.chat.messages.push(branchFrom(retyped(question, area.value), replaced));
      renderMessages();
      reply();
    }, "resend"),
    button("Cancel", renderMessages, "cancel"));
  area.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      bar.querySelector(".resend").click();
    }
  });
  area.focus();
}

// ---- the token card (hover, or tap on a touch screen) ----

// A token's details: a compared reply's column holds its own (they are not in the chat).
function detailOf(span) {
  const content = span.closest(".content");
  if (content?.details) return content.details[span.dataset.i];
  const message = span.closest(".message");
  return state.chat?.messages[message?.dataset.index]?.details?.[span.dataset.i];
}

function showCard(span) {
  const detail = detailOf(span);
  const card = $("card");
  if (!detail) {
    card.hidden = true;
    return;
  }
  fillCard(card, detail);
  card.hidden = false;
  const box = span.getBoundingClientRect();
  const width = card.offsetWidth;
  card.style.left = `${Math.max(4, Math.min(box.left, window.innerWidth - width - 4))}px`;
  const below = box.bottom + 6 + card.offsetHeight < window.innerHeight;
  card.style.top = `${below ? box.bottom + 6 : box.top - card.offsetHeight - 6}px`;
}

// A mouse shows a token's card while over it; a tap (or a click) pins it until a tap
// elsewhere. Touch screens send mouse events after a tap too: only a mouse's count.
function watchTokens() {
  const holder = $("messages");
  holder.addEventListener("pointerover", (event) => {
    const span = event.target.closest?.(".tok");
    if (span && event.pointerType === "mouse" && !state.pinned) showCard(span);
  });
  holder.addEventListener("pointerout", (event) => {
    if (event.target.closest?.(".tok") && event.pointerType === "mouse" && !state.pinned) {
      $("card").hidden = true;
    }
  });
  document.addEventListener("click", (event) => {
    if (state.pinned && !event.target.closest?.(".tok, #card")) {
      state.pinned = null;
      $("card").hidden = true;
    }
  });
  holder.addEventListener("click", (event) => {
    const span = event.target.closest?.(".tok");
    if (span) {
      state.pinned = span;
      showCard(span);
    }
    const copy = event.target.closest?.(".copy-code");
    if (copy) {
      copyText(copy.closest(".code-block").querySelector("code").textContent);
      copied(copy);
    }
  });
}

// Escape: stops a reply, else closes what is open (settings, a token's card, the chats).
function escape() {
  if (state.running) state.running.abort();
  else if (!$("settings").hidden) showSettings(false);
  else if (!$("card").hidden) {
    state.pinned = null;
    $("card").hidden = true;
  } else if (document.body.classList.contains("sidebar-open")) $("toggle-sidebar").click();
}

// The page's shortcuts (listed in the sidebar): Ctrl+Shift+O a new chat, Ctrl+K search.
function shortcut(event) {
  const mod = event.ctrlKey || event.metaKey;
  if (mod && event.shiftKey && event.key.toLowerCase() === "o") {
    openChat(null);
    $("input").focus();
    return true;
  }
  if (mod && !event.shiftKey && event.key.toLowerCase() === "k") {
    const phone = window.matchMedia("(max-width: 700px)").matches;
    if (phone && !document.body.classList.contains("sidebar-open")) $("toggle-sidebar").click();
    $("chat-search").focus();
    $("chat-search").select();
    return true;
  }
  return false;
}

// A reply in the token view takes focus as one stop; the arrows walk its tokens, each
// card shown (pinned) in turn.
function walkTokens(event) {
  const content = event.target.closest?.(".content.token-view");
  const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
  if (!content || event.target !== content || !step) return;
  const spans = [...content.querySelectorAll(".tok")];
  const at = spans.indexOf(state.pinned);
  const next = spans[Math.max(0, Math.min(spans.length - 1, at < 0 ? 0 : at + step))];
  if (!next) return;
  event.preventDefault();
  state.pinned = next;
  showCard(next);
}

// ---- the page ----

function applyTheme() {
  const dark = state.settings.theme ? state.settings.theme === "dark"
    : window.matchMedia("(prefers-color-scheme: dark)").matches;
  document.documentElement.dataset.theme = dark ? "dark" : "light";
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

async function loadModels() {
  const models = await api.models();
  const select = $("model");
  select.replaceChildren(...models.map((m) => {
    const option = el("option", "", m.id);
    option.value = m.id;
    return option;
  }));
  if (models.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
  state.settings.model = select.value;
}

function wire() {
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", autosize);
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => state.running?.abort());
  $("new-chat").addEventListener("click", () => openChat(null));
  $("notice-undo").addEventListener("click", () => {
    const undo = state.undo;
    showNotice("");
    undo?.();
  });
  $("export").addEventListener("click", exportChat);
  $("import-file").addEventListener("change", (event) => {
    const [file] = event.target.files;
    if (file) importChat(file);
    event.target.value = "";
  });
  $("error-close").addEventListener("click", () => showError(""));
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    persist();
  });
  $("token-view").checked = state.settings.tokenView;
  $("token-view").addEventListener("change", () => {
    state.settings.tokenView = $("token-view").checked;
    persist();
    renderMessages();
    const live = state.live;  // a reply streaming: on, in its redrawn node
    const index = live ? state.chat.messages.indexOf(live.message) : -1;
    const node = $("messages").querySelector(`.message[data-index="${index}"] .content`);
    if (node) live.moveTo(node, state.settings.tokenView);
  });
  $("theme").addEventListener("click", () => {
    state.settings.theme = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    applyTheme();
    persist();
  });
  $("toggle-sidebar").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  });
  setupCompare({ stream, requestBody, setRunning, seedOf, freshSeed, showError });
  setupChats(renderMessages);
  $("chat-search").addEventListener("input", renderChatList);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") escape();
    else if (shortcut(event)) event.preventDefault();
    else walkTokens(event);
  });
  $("import").addEventListener("click", () => $("import-file").click());
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", (event) => {
    attach([...event.target.files]);
    event.target.value = "";
  });
  watchTokens();
  wireSettings();
}

async function start() {
  applyTheme();
  wire();
  try {
    state.chats = await loadChats();
  } catch (error) {
    showError(`The chats kept in this browser cannot be read: ${error?.message}`);
  }
  const open = sessionStorage.getItem(OPEN_CHAT);
  state.chat = state.chats.find((c) => c.id === open) || state.chats[0] || null;
  selectChat(state.chat);
  try {
    await loadModels();
    state.table = await api.samplers();
    buildSettings();
    listSamplers();
  } catch (error) {
    showError(error instanceof ApiError ? error.message : `The server did not answer: ${error.message}`);
  }
  $("input").focus();
}

start();
