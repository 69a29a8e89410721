// The chats in the sidebar: the one open, opening another, search, rename, delete with
// an undo, and export and import as the REPL's /save files.

import { el } from "./markdown.js";
import { $, button, persist, showError, showNotice, spec, state } from "./page.js";
import { buildSettings } from "./settings.js";
import { parseSpec } from "./spec.js";
import { exported, imported, newChat } from "./store.js";

// The chat open in this tab, kept across a reload (a new tab opens the newest).
export const OPEN_CHAT = "adaptive-llama.open-chat";

// How the open chat's messages are drawn: set by app.js.
let drawMessages = () => {};

export function setupChats(renderMessages) {
  drawMessages = renderMessages;
}


export function currentChat() {
  if (!state.chat) {
    state.chat = newChat(state.settings);
    state.chats.unshift(state.chat);
  }
  return state.chat;
}

// Open `chat` (null: a new one); a reply still streaming is stopped first, and kept.
export async function openChat(chat) {
  if (chat && chat === state.chat) return;
  if (state.running) {
    state.running.abort();
    await state.idle;
  }
  selectChat(chat);
}

export function selectChat(chat) {
  if (state.running) return;
  state.chat = chat;
  if (chat) sessionStorage.setItem(OPEN_CHAT, chat.id);
  else sessionStorage.removeItem(OPEN_CHAT);
  $("system").value = chat?.system ?? state.settings.system;
  renderChatList();
  drawMessages();
  if (window.matchMedia("(max-width: 700px)").matches) document.body.classList.remove("sidebar-open");
}

// Whether a chat's title or any of its messages holds every word of `query`.
function matches(chat, query) {
  const words = query.toLowerCase().split(/\s+/).filter(Boolean);
  const text = [chat.title, ...chat.messages.map((m) => m.content)].join("\n").toLowerCase();
  return words.every((word) => text.includes(word));
}

export function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren();
  const query = $("chat-search").value;
  const shown = state.chats.filter((chat) => matches(chat, query));
  for (const chat of shown) {
    const item = list.appendChild(el("li", chat === state.chat ? "active" : ""));
    const title = item.appendChild(button(chat.title || "New chat", () => openChat(chat),
      "chat-title"));
    title.title = "Double-click to rename";
    title.addEventListener("dblclick", () => renameChat(chat, item));
    item.append(button("×", () => deleteChat(chat), "delete-chat"));
    item.lastChild.setAttribute("aria-label", `Delete ${chat.title}`);
  }
  if (!shown.length && query) list.append(el("li", "no-match", "No chat holds these words."));
}

// The title becomes a field: Enter keeps what is typed (empty: the old title), Escape
// or leaving it cancels.
function renameChat(chat, item) {
  const input = el("input", "rename");
  input.value = chat.title;
  input.setAttribute("aria-label", "New title");
  item.querySelector(".chat-title").replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (keep && title) {
      chat.title = title;
      persist();
    }
    renderChatList();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    else if (event.key === "Escape") {
      event.stopPropagation();  // not the page's Escape (stop a reply)
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(false));
}

function deleteChat(chat) {
  if (state.running && chat === state.chat) return;
  const at = state.chats.indexOf(chat);
  const wasOpen = state.chat === chat;
  state.chats = state.chats.filter((c) => c !== chat);
  if (wasOpen) state.chat = null;
  persist();
  selectChat(state.chat);
  showNotice(`Deleted "${chat.title || "New chat"}".`, () => {
    state.chats.splice(at, 0, chat);
    persist();
    if (wasOpen) openChat(chat);
    else renderChatList();
  });
}

export function exportChat() {
  const chat = state.chat;
  if (!chat?.messages.length) {
    showError("Nothing to export yet: this chat has no messages.");
    return;
  }
  const data = { ...exported(chat, state.settings), sampler: chat.spec || spec() };
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const a = el("a");
  a.href = URL.createObjectURL(blob);
  a.download = `${(chat.title || "chat").replace(/[^\w.-]+/g, "-").slice(0, 40) || "chat"}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

export async function importChat(file) {
  try {
    const { chat, settings } = imported(await file.text(), file.name, state.settings);
    const before = structuredClone(state.settings);
    if (settings.spec) Object.assign(state.settings, parseSpec(settings.spec, state.table));
    if (settings.seed !== undefined) state.settings.seed = settings.seed;
    if (settings.maxTokens !== undefined) state.settings.maxTokens = settings.maxTokens;
    chat.spec = settings.spec;
    state.chats.unshift(chat);
    persist();
    buildSettings();
    await openChat(chat);
    showError("");
    // the file's settings now apply: say which, and let them be put back
    const taken = [settings.spec && `sampler ${settings.spec}`,
      settings.seed !== undefined && `seed ${settings.seed}`,
      settings.maxTokens !== undefined && `max tokens ${settings.maxTokens}`].filter(Boolean);
    if (taken.length) {
      showNotice(`Imported ${file.name}; settings from the file: ${taken.join(", ")}.`, () => {
        state.settings = before;
        persist();
        buildSettings();
      });
    }
  } catch (error) {
    showError(`Cannot import ${file.name}: ${error.message}`);
  }
}
