// Conversations kept in the browser (IndexedDB, one record per chat), and their export and
// import as the REPL's /save JSON: {version, model, sampler, seed, max_tokens, system,
// messages}, where a message is {role: "user"|"assistant", content, interrupted?}. A file
// exported here loads in the REPL (/load FILE, or run --resume FILE), and a /save file
// imports here.

import { everyVersion } from "./branches.js";

const DATABASE = "adaptive-llama";
const CHATS = "chats";
const OLD_CHATS = "adaptive-llama.chats";  // where earlier versions of the page kept them
const SETTINGS = "adaptive-llama.settings";
const MAX_IMPORT_BYTES = 64 * 2 ** 20;  // the REPL's limit on a chat file

export function newChat(settings) {
  return {
    id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat", updated: Date.now(), model: settings.model || "",
    system: settings.system || "", messages: [],
  };
}

let database = null;
function openDatabase() {
  database ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DATABASE, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(CHATS, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return database;
}

// Settles when the transaction has ended: its error if it failed (a full storage aborts it).
function ended(transaction) {
  return new Promise((resolve, reject) => {
    transaction.oncomplete = () => resolve();
    transaction.onabort = transaction.onerror = () => reject(transaction.error);
  });
}

const written = new Map();  // chat id -> its JSON as last written: only changes are written

const newestFirst = (a, b) => (a.id < b.id ? 1 : -1);  // ids begin with the time they were made

// The chats as they are stored, the newest first.
export async function storedChats() {
  const transaction = (await openDatabase()).transaction(CHATS);
  const request = transaction.objectStore(CHATS).getAll();
  await ended(transaction);
  return request.result.filter((c) => c && Array.isArray(c.messages)).sort(newestFirst);
}

export async function loadChats() {
  const stored = await storedChats();
  const moved = await movedFromLocalStorage(new Set(stored.map((chat) => chat.id)));
  const chats = moved.length ? [...stored, ...moved].sort(newestFirst) : stored;
  for (const chat of chats) written.set(chat.id, JSON.stringify(chat));
  return chats;
}

// The chats an earlier version of the page kept in localStorage that are not stored here
// yet (`here`: the ids stored), moved here. A move cut short (the tab closed while it
// wrote) ends on the next visit, without a chat twice.
async function movedFromLocalStorage(here) {
  let chats;
  try {
    chats = JSON.parse(localStorage.getItem(OLD_CHATS) || "[]");
  } catch {
    return [];
  }
  chats = Array.isArray(chats)
    ? chats.filter((c) => c && Array.isArray(c.messages) && !here.has(c.id)) : [];
  if (chats.length) await saveChats(chats);
  localStorage.removeItem(OLD_CHATS);
  return chats;
}

// Keeps every chat; when the browser's quota is reached, the per-token details of the
// oldest replies go first (the text stays), then an error says that nothing more fits.
export async function saveChats(chats) {
  for (;;) {
    const texts = new Map(chats.map((chat) => [chat.id, JSON.stringify(chat)]));
    const transaction = (await openDatabase()).transaction(CHATS, "readwrite");
    const store = transaction.objectStore(CHATS);
    for (const chat of chats) if (written.get(chat.id) !== texts.get(chat.id)) store.put(chat);
    for (const id of written.keys()) if (!texts.has(id)) store.delete(id);
    try {
      await ended(transaction);
      written.clear();
      texts.forEach((text, id) => written.set(id, text));
      return;
    } catch (error) {
      if (error?.name !== "QuotaExceededError") {
        throw new Error(`The chats could not be kept: ${error?.message}`);
      }
      if (!dropOldestDetails(chats)) throw new Error(`The browser's storage is full: ${error.message}`);
    }
  }
}

function dropOldestDetails(chats) {
  const byAge = [...chats].sort((a, b) => a.updated - b.updated);
  for (const chat of byAge) {
    // a reply's earlier versions (Regenerate, an edited question) go before the one shown,
    // a reply's comparison before its own tokens
    const reply = [...everyVersion(chat.messages)].find((m) => m.details || m.comparison);
    if (reply) {
      delete reply[reply.comparison ? "comparison" : "details"];
      return true;
    }
  }
  return false;
}

export function loadSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch {
    return {};
  }
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

// The chat as the REPL's /save writes it.
export function exported(chat, settings) {
  const number = (value) => (value === "" || value == null ? null : Number(value));
  const maxTokens = number(settings.maxTokens);
  return {
    version: 1,
    model: chat.model || settings.model || "",
    sampler: settings.spec || "adaptive",
    seed: number(settings.seed),
    ...(maxTokens ? { max_tokens: maxTokens } : {}),  // none: the REPL keeps its own
    system: chat.system || null,
    messages: chat.messages.map(savedMessage),
  };
}

// A message as the REPL saves it: a reasoning model's thinking apart from its answer.
function savedMessage(m) {
  return {
    role: m.role, content: m.content, ...(m.reasoning ? { reasoning: m.reasoning } : {}),
    ...(m.interrupted ? { interrupted: true } : {}),
  };
}

// A chat from a /save file's text, every field checked as the REPL checks it; Error says
// what is wrong.
export function imported(text, name, settings) {
  if (text.length > MAX_IMPORT_BYTES) throw new Error("it is larger than 64 MiB");
  let data;
  try {
    data = JSON.parse(text);
  } catch (error) {
    throw new Error(`it is not JSON (${error.message})`);
  }
  if (!data || typeof data !== "object" || Array.isArray(data)) {
    throw new Error("it is not a JSON object");
  }
  const { messages } = data;
  if (!Array.isArray(messages) || !messages.every((m) => m && typeof m === "object"
      && (m.role === "user" || m.role === "assistant") && typeof m.content === "string"
      && (m.interrupted === undefined || typeof m.interrupted === "boolean")
      && (m.reasoning == null || typeof m.reasoning === "string"))) {
    throw new Error("`messages` has to be a list of {role: user|assistant, content: text}");
  }
  if (data.system != null && typeof data.system !== "string") {
    throw new Error("`system` has to be text");
  }
  const chat = newChat({ ...settings, system: data.system ?? "" });
  chat.title = titleOf(messages) || name.replace(/\.json$/i, "");
  chat.messages = messages.map(savedMessage);
  const imported = {};
  if (typeof data.sampler === "string") imported.spec = data.sampler;
  if (Number.isInteger(data.seed)) imported.seed = data.seed;
  if (Number.isInteger(data.max_tokens)) imported.maxTokens = data.max_tokens;
  return { chat, settings: imported };
}

export function titleOf(messages) {
  const first = messages.find((m) => m.role === "user");
  return first ? first.content.trim().split("\n")[0].slice(0, 60) : "";
}
