// Branches of a chat. A question edited, or a reply made again, keeps what it replaced as
// an earlier version of that message, together with the messages that followed it; ‹ › at
// the message then moves between whole branches of the conversation.
//
// The version shown lives in the message itself and in the chat's messages after it. The
// others live in message.versions (null at the shown one's place), each with the messages
// that followed it as `rest`, so nothing is stored twice.

const VERSION_FIELDS = ["content", "typed", "files", "spec", "seed", "details", "stats",
  "reasoning", "interrupted", "comparison"];

function versionOf(message, rest) {
  const version = Object.fromEntries(VERSION_FIELDS.filter((f) => message[f] !== undefined)
    .map((f) => [f, message[f]]));
  version.rest = rest;
  return version;
}

// Takes the message at `index`, and every one after it, out of `messages`: what a new
// version of it replaces.
export function cutAt(messages, index) {
  const [previous, ...rest] = messages.splice(index);
  return { previous, rest };
}

// Puts back what `cutAt` took out (the new version came to nothing).
export function putBack(messages, { previous, rest }) {
  messages.push(previous, ...rest);
}

// `message`, a new version of the one cut out, keeps the versions before it and comes last.
export function branchFrom(message, { previous, rest }) {
  const versions = [...(previous.versions || [null])];
  versions[previous.shown ?? 0] = versionOf(previous, rest);
  message.versions = [...versions, null];
  message.shown = versions.length;
  return message;
}

// Shows version `target` of the message at `index`, with its own messages after it.
export function showVersion(messages, index, target) {
  const message = messages[index];
  message.versions[message.shown] = versionOf(message, messages.slice(index + 1));
  for (const f of VERSION_FIELDS) delete message[f];
  const { rest = [], ...fields } = message.versions[target];  // a reply's versions of old: none
  Object.assign(message, fields);
  message.versions[target] = null;
  message.shown = target;
  messages.splice(index + 1, Infinity, ...rest);
}

// Every message of every branch; a message's earlier versions (and their branches) first.
export function* everyVersion(messages) {
  for (const message of messages) {
    for (const version of message.versions || []) {
      if (!version) continue;
      yield version;
      yield* everyVersion(version.rest || []);
    }
    yield message;
  }
}
