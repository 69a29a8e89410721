// Conversations kept in the browser (localStorage), and their export and import as the
// REPL's /save JSON: {version, model, sampler, seed, max_tokens, system, messages}, where a
// message is {role: "user"|"assistant", content, interrupted?}. A file exported here loads
// in the REPL (/load FILE, or run --resume FILE), and a /save file imports here.

const CHATS = "adaptive-llama.chats";
const SETTINGS = "adaptive-llama.settings";
const MAX_IMPORT_BYTES = 64 * 2 ** 20;  // the REPL's limit on a chat file

export function newChat(settings) {
  return {
    id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat", updated: Date.now(), model: settings.model || "",
    system: settings.system || "", messages: [],
  };
}

export function loadChats() {
  try {
    const chats = JSON.parse(localStorage.getItem(CHATS) || "[]");
    return Array.isArray(chats) ? chats.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

// Keeps every chat; when the browser's quota is reached, the per-token details of the
// oldest replies go first (the text stays), then an error says that nothing more fits.
export function saveChats(chats) {
  for (;;) {
    try {
      localStorage.setItem(CHATS, JSON.stringify(chats));
      return;
    } catch (error) {
      if (!dropOldestDetails(chats)) throw new Error(`the browser's storage is full: ${error.message}`);
    }
  }
}

function dropOldestDetails(chats) {
  const byAge = [...chats].sort((a, b) => a.updated - b.updated);
  for (const chat of byAge) {
    // a reply's earlier versions (Regenerate) count as its own, shown one
    const replies = chat.messages.flatMap((m) => [...(m.versions || []).filter(Boolean), m]);
    const reply = replies.find((m) => m.details);
    if (reply) {
      delete reply.details;
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
