// The page's state and the small helpers every part of it uses: the chats, the settings,
// the reply streaming now, and the lines that say what went wrong or what just happened.

import { el } from "./markdown.js";
import { loadSettings, saveChats, saveSettings } from "./store.js";
import { specOf } from "./spec.js";

export const $ = (id) => document.getElementById(id);
window.adaptiveLlama = { ...(window.adaptiveLlama || {}), saved: Promise.resolve() };
export const DEFAULTS = { sampler: "adaptive", params: {}, modifiers: {}, temperature: "", seed: "",
  maxTokens: 512, system: "", tokenView: false, theme: "", model: "" };

export const state = {
  settings: { ...DEFAULTS, ...loadSettings() },
  chats: [],        // every chat, newest first (loaded from IndexedDB at start)
  chat: null,
  table: [],        // the server's samplers and modifiers (/web/samplers.json)
  running: null,    // the AbortController of the reply streaming now
  live: null,       // the LiveReply streaming now
  pinned: null,     // the token whose card stays shown (tapped or clicked)
  idle: Promise.resolve(),  // settles when the reply streaming now has ended
  undo: null,       // what the notice's Undo does
  attachments: [],  // {name, text} of the files the next question carries
};
export function button(label, onClick, className = "") {
  const node = el("button", className, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

export function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = !message;
}

// One line that says what just happened, with an Undo for a while.
let noticeTimer = null;
export function showNotice(message, undo) {
  clearTimeout(noticeTimer);
  state.undo = undo;
  $("notice-text").textContent = message;
  $("notice").hidden = !message;
  if (message) noticeTimer = setTimeout(() => showNotice(""), 10_000);
}

// Keeps the chats and settings; the chats are written in the background, in order
// (window.adaptiveLlama.saved settles when the latest write has ended).
export function persist() {
  window.adaptiveLlama.saved = saveChats(state.chats).catch((error) => showError(error.message));
  try {
    saveSettings(state.settings);
  } catch (error) {
    showError(error.message);
  }
}

export function spec() {
  return specOf(state.settings, state.table);
}
