// The server's OpenAI routes, as the page calls them: same origin, the API key (when the
// server asks for one) in sessionStorage, so that the page asks for it once per tab.

const KEY = "adaptive-llama.api-key";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export class Api {
  // askKey(wrongKey): a Promise of the key the user typed (null: they gave up).
  constructor(askKey) {
    this.askKey = askKey;
  }

  headers() {
    const key = sessionStorage.getItem(KEY);
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  // fetch, asking for the key again while the server answers 401.
  async request(path, options = {}) {
    for (;;) {
      const response = await fetch(path, { ...options, headers: this.headers() });
      if (response.status !== 401) return response;
      const key = await this.askKey(sessionStorage.getItem(KEY) !== null);
      if (key === null) throw new ApiError(await errorText(response), 401);
      sessionStorage.setItem(KEY, key);
    }
  }

  async json(path, options) {
    const response = await this.request(path, options);
    if (!response.ok) throw new ApiError(await errorText(response), response.status);
    return response.json();
  }

  models() { return this.json("/v1/models").then((r) => r.data); }

  samplers() { return this.json("/web/samplers.json").then((r) => r.samplers); }

  // {text, pages} of a PDF (its bytes in base64), read by the server.
  pdfText(name, data) {
    return this.json("/web/pdf-text", { method: "POST", body: JSON.stringify({ name, data }) });
  }

  // The chunks of a streamed chat completion, as objects; an error (HTTP or in the stream)
  // throws ApiError with the server's one-line message. `signal` aborts it.
  async *chat(body, signal) {
    const response = await this.request("/v1/chat/completions", {
      method: "POST", body: JSON.stringify({ ...body, stream: true }), signal,
    });
    if (!response.ok) throw new ApiError(await errorText(response), response.status);
    // Chromium counts a request whose body only a script read as aborted (net::ERR_ABORTED)
    // when the body's end reaches the script before the request's own end, as it mostly does
    // on a busy machine. A copy that the browser itself reads (a blob) holds the request
    // until its end; it costs a copy of the bytes for the reply's duration.
    response.clone().blob().catch(() => {});  // a stop or a lost connection: reported below
    for await (const data of events(response.body)) {
      // the stream is read to its end after [DONE], so that the request ends as finished
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.message || String(chunk.error), 500);
      yield chunk;
    }
  }
}

// The message of an error answer ({"error": {"message"}}), else its status line.
async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || body.error || `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The data of each server-sent event in a byte stream.
export async function* events(stream) {
  // The bytes are read straight from the body and decoded here: read through a
  // TextDecoderStream pipe, a finished stream was reported as aborted (net::ERR_ABORTED)
  // whenever the machine was busy, though every byte had come.
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let ended = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if ((ended = done)) return;
      buffer += decoder.decode(value, { stream: true });  // events end with "\n\n"
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    if (!ended) reader.cancel().catch(() => {});  // left early (an error): the request goes
  }
}
