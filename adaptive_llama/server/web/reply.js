// One assistant reply on the page: streamed in (its markdown redrawn once a frame, or in the
// token view each token's coloured span appended; the view following it down), then shown
// whole once it ends, with the plot of k under it. A reasoning model's thinking streams into
// a block of its own above the answer, open while it grows and closed once the answer starts.
//
// The time spent on each streamed chunk is added to window.adaptiveLlama.render, so that a
// benchmark (benchmarks/bench_web.py) reads the cost per token in a real browser.

import { renderMarkdown } from "./markdown.js";
import { plot, renderTokens } from "./tokens.js";
import { typeset } from "./typeset.js";

export const renderCost = { tokens: 0, ms: 0, worstMs: 0 };
window.adaptiveLlama = { ...(window.adaptiveLlama || {}), render: renderCost };

// A message's contents, whole: markdown, or with `tokenView` its tokens coloured by k.
export function showMessage(content, message, tokenView) {
  content.replaceChildren();
  const tokens = Boolean(tokenView && message.details);
  content.classList.toggle("token-view", tokens);
  // one Tab stop per reply; the arrows walk its tokens (app.js walkTokens)
  if (tokens) {
    content.tabIndex = 0;
    content.setAttribute("aria-label", "The reply as tokens: arrow keys show each token's card");
  } else {
    content.removeAttribute("tabindex");
    content.removeAttribute("aria-label");
  }
  if (tokens) renderTokens(content, message.details);
  else if (message.role === "assistant") {
    content.append(renderMarkdown(message.content));
    typeset(content);
  }
  // what the user typed, as typed (its attached files are shown by name beside it)
  else content.textContent = message.typed ?? message.content;
}

// A reasoning model's thinking above its answer (message.reasoning): open while it streams,
// closed when drawn whole. In the token view the thinking's tokens show it instead (dimmed).
export function thinkingBlock(message, streaming) {
  const block = document.createElement("details");
  block.className = "thinking";
  block.open = Boolean(streaming);
  const summary = block.appendChild(document.createElement("summary"));
  summary.textContent = streaming ? "Thinking…" : thoughtFor(message);
  const text = block.appendChild(document.createElement("div"));
  text.className = "thinking-text";
  text.textContent = message.reasoning || "";
  return block;
}

function thoughtFor(message) {
  const tokens = message.stats?.reasoning_tokens;
  return tokens ? `Thought for ${tokens} tokens` : "Thought";
}

// The plot under a reply, when its tokens have a k.
export function showPlot(holder, message) {
  holder.replaceChildren();
  if (!message.details?.some((d) => d.k != null)) return;
  holder.append(plot(message.details));
  const legend = holder.appendChild(document.createElement("div"));
  legend.className = "plot-legend";
  for (const [name, text] of [["k", "k, the candidate-set size"], ["entropy", "entropy"]]) {
    const entry = legend.appendChild(document.createElement("span"));
    entry.className = `legend-${name}`;
    entry.textContent = text;
  }
}

// A block longer than this (a long list: no blank line) is drawn in parts while it grows.
const LONGEST_BLOCK = 2000;

// Where the finished blocks of `text` end after `from`: after its last blank line, or for a
// block past LONGEST_BLOCK after its last whole line; `from` where that falls inside a code
// block or nothing finished.
export function finishedBlocks(text, from) {
  const blank = text.lastIndexOf("\n\n");
  let end = blank >= from ? blank + 2 : -1;
  if (end < 0 && text.length - from > LONGEST_BLOCK) {
    const line = text.lastIndexOf("\n");
    end = line >= from ? line + 1 : -1;
  }
  if (end <= from) return from;
  const fences = (text.slice(from, end).match(/^```/gm) || []).length;
  return fences % 2 === 0 ? end : from;
}

export class LiveReply {
  // message: the {role: "assistant", content, details} object the chunks fill.
  constructor(content, message, tokenView) {
    this.message = message;
    this.scrollPending = false;
    this.redrawPending = false;
    this.moveTo(content, tokenView);
  }

  // Stream on into `content` (the page redrew the messages: Tokens turned on or off), with
  // what came so far drawn there the new way.
  moveTo(content, tokenView) {
    this.content = content;
    this.tokenView = tokenView;
    this.thinking = null;
    if (this.message.reasoning) this.showThinking("");
    content.replaceChildren();
    content.classList.add("streaming");
    content.classList.toggle("token-view", tokenView);
    // markdown: the finished blocks drawn once into head, the last one redrawn in tail
    this.stable = 0;
    this.head = this.tail = null;
    if (tokenView) renderTokens(content, this.message.details || []);
    else {
      this.head = content.appendChild(document.createElement("div"));
      this.tail = content.appendChild(document.createElement("div"));
      if (this.message.content) this.redraw();
    }
    this.holder = content.closest("#messages");
    this.followedHeight = this.holder ? this.holder.scrollHeight : 0;
  }

  // The reply so far as markdown, once a frame (a chunk's text alone would show raw ``` and
  // ** until the end): the blocks finished since the last frame (up to a blank line outside
  // a code block) drawn once, the block still growing drawn again, so that a frame's work
  // does not grow with the reply. finish() draws it whole. Its cost goes to renderCost.
  redraw() {
    if (this.redrawPending) return;
    this.redrawPending = true;
    requestAnimationFrame(() => {
      this.redrawPending = false;
      if (!this.content.classList.contains("streaming") || !this.tail) return;
      const started = performance.now();
      const text = this.message.content;
      const cut = finishedBlocks(text, this.stable);
      if (cut > this.stable) {
        this.head.append(renderMarkdown(text.slice(this.stable, cut)));
        typeset(this.head);  // the finished blocks' code and math, typeset while it streams
        this.stable = cut;
      }
      this.tail.replaceChildren(renderMarkdown(text.slice(this.stable)));
      renderCost.ms += performance.now() - started;
    });
  }

  // Keep the growing reply in view, once a frame, unless the reader scrolled up from the
  // bottom: the bottom seen now against the height at the last follow.
  follow() {
    if (this.scrollPending || !this.holder) return;
    this.scrollPending = true;
    requestAnimationFrame(() => {
      this.scrollPending = false;
      const holder = this.holder;
      if (this.followedHeight - (holder.scrollTop + holder.clientHeight) < 48) {
        holder.scrollTop = holder.scrollHeight;
      }
      this.followedHeight = holder.scrollHeight;
    });
  }

  // The thinking so far, and `thought` added to it, in its block above the answer (made
  // when the first of it comes; none in the token view, whose tokens show it).
  showThinking(thought) {
    if (this.tokenView) return;
    if (!this.thinking) {
      this.thinking = thinkingBlock(this.message, !this.message.content);
      this.thinking.querySelector("summary").addEventListener("click", () => {
        this.readerToggled = true;
      });
      this.content.before(this.thinking);
    } else if (thought) {
      this.thinking.querySelector(".thinking-text").append(thought);
    }
  }

  // One chunk of the stream: its text, its thinking and its tokens' details.
  add(text, details, thought) {
    const started = performance.now();
    const { message } = this;
    if (thought) {
      message.reasoning = (message.reasoning || "") + thought;
      this.showThinking(thought);
    }
    if (text && !message.content && this.thinking) {
      // the answer starts: the thinking folds away, unless the reader chose otherwise
      if (!this.readerToggled) this.thinking.open = false;
      this.thinking.querySelector("summary").textContent = "Thought";
    }
    if (text) message.content += text;
    if (details?.length) {
      const first = (message.details ||= []).length;
      message.details.push(...details);
      if (this.tokenView) renderTokens(this.content, details, first);
    }
    if (text && !this.tokenView) this.redraw();
    this.follow();
    const spent = performance.now() - started;
    renderCost.tokens += details?.length || (text || thought ? 1 : 0);
    renderCost.ms += spent;
    renderCost.worstMs = Math.max(renderCost.worstMs, spent);
  }

  finish() {
    this.content.classList.remove("streaming");
    showMessage(this.content, this.message, this.tokenView);
  }
}
