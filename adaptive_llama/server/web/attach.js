// Text, code and PDF files attached to a question: read in the browser and checked to be
// text (a PDF's text is read by the server: pypdf, POST /web/pdf-text), then sent inside
// the question, each after its name in a fenced block. The model reads text only, so an
// image or another binary file is refused in one line.

export const MAX_FILE_BYTES = 2 ** 20;

// {name, text} of a file, or an Error that says why it cannot be attached. `pdfText(name,
// base64)` answers a PDF's {text}, or throws the server's one line.
export async function readAttachment(file, pdfText) {
  if (file.size > MAX_FILE_BYTES) throw new Error(`${file.name} is larger than 1 MiB`);
  const bytes = new Uint8Array(await file.arrayBuffer());
  if (isPdf(bytes)) {
    return { name: file.name, text: (await pdfText(file.name, base64(bytes))).text };
  }
  if (bytes.includes(0)) {
    throw new Error(`${file.name} is not text (an image or another binary file): `
      + "attach text, code or a PDF");
  }
  try {
    return { name: file.name, text: new TextDecoder("utf-8", { fatal: true }).decode(bytes) };
  } catch {
    throw new Error(`${file.name} is not UTF-8 text`);
  }
}

const isPdf = (bytes) => String.fromCharCode(...bytes.subarray(0, 5)) === "%PDF-";

function base64(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
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
