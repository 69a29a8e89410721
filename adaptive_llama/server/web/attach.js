// Text and code files attached to a question: read in the browser, checked to be text, and
// sent inside the question, each after its name in a fenced block (the model reads text
// only, so a PDF, an image or another binary file is refused in one line).

export const MAX_FILE_BYTES = 2 ** 20;

// {name, text} of a file, or an Error that says why it cannot be attached.
export async function readAttachment(file) {
  if (file.size > MAX_FILE_BYTES) throw new Error(`${file.name} is larger than 1 MiB`);
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (bytes.includes(0)) {
    throw new Error(`${file.name} is not text (a PDF, an image or another binary file): `
      + "attach text or code");
  }
  try {
    return { name: file.name, text: new TextDecoder("utf-8", { fatal: true }).decode(bytes) };
  } catch {
    throw new Error(`${file.name} is not UTF-8 text`);
  }
}

// The question as the model reads it: what was typed, then each file under its name.
export function withAttachments(typed, files) {
  const blocks = files.map((f) => {
    const fence = fenceFor(f.text);
    return `${f.name}:\n${fence}\n${f.text.replace(/\n$/, "")}\n${fence}`;
  });
  return [typed.trim() ? typed : "", ...blocks].filter(Boolean).join("\n\n");
}

// A fence longer than any run of backticks in the text, so that the text cannot close it.
function fenceFor(text) {
  const runs = (text.match(/`+/g) || []).map((run) => run.length);
  return "`".repeat(Math.max(2, ...runs) + 1);
}

// `question` with its text typed again; the files it carried stay attached.
export function retyped(question, typed) {
  if (!question.files) return { role: "user", content: typed };
  // the files' blocks: what withAttachments wrote after the text typed then
  const blocks = question.typed.trim() ? question.content.slice(question.typed.length + 2)
    : question.content;
  const content = [typed.trim() ? typed : "", blocks].filter(Boolean).join("\n\n");
  return { role: "user", content, typed, files: question.files };
}
