// What adaptive decoding did at each token, shown: a reply's tokens coloured by their
// candidate-set size k (the REPL's /trace colours), a card with k, the kept mass, the
// entropy and the likeliest candidates when a token is hovered or tapped, and a plot of k
// and entropy along the reply. A token's details are the server's `token_details` entries.

const SVG = "http://www.w3.org/2000/svg";

// The REPL's buckets: blue k=1 (sure), green 2-5, yellow 6-20, red above 20 (hesitant).
export function kClass(k) {
  if (k == null) return "k-none";
  if (k <= 1) return "k-1";
  if (k <= 5) return "k-5";
  if (k <= 20) return "k-20";
  return "k-many";
}

export function tokenSpan(detail, index) {
  const span = document.createElement("span");
  // a reasoning model's thinking: dimmed, apart from the answer's tokens
  span.className = `tok ${kClass(detail.k)}${detail.phase === "thinking" ? " thought" : ""}`;
  span.dataset.i = index;
  span.textContent = detail.text;
  return span;
}

// Tokens as coloured spans, appended to `container` (one node per token as it comes);
// `start`: the index of the first in the whole reply.
export function renderTokens(container, details, start = 0) {
  const fragment = document.createDocumentFragment();
  details.forEach((detail, i) => fragment.append(tokenSpan(detail, start + i)));
  container.append(fragment);
}

// What the colours mean, in plain words, under a reply in the token view.
export function kLegend() {
  const legend = document.createElement("div");
  legend.className = "k-legend";
  legend.append("Candidates kept (k): ");
  for (const [k, text] of [[1, "1, sure"], [5, "2-5"], [20, "6-20"], [21, "over 20, hesitant"]]) {
    const span = legend.appendChild(document.createElement("span"));
    span.className = `k-swatch ${kClass(k)}`;
    span.textContent = text;
  }
  return legend;
}

// Whitespace made visible in a candidate's text: "␣" for a space, "↵" for a new line.
export function visible(text) {
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
}

function percent(p) {
  return p >= 0.995 ? "100%" : p >= 0.1 ? `${(p * 100).toFixed(0)}%` : `${(p * 100).toFixed(1)}%`;
}

// The card's contents for one token.
export function fillCard(card, detail) {
  card.replaceChildren();
  const head = card.appendChild(document.createElement("div"));
  head.className = "card-head";
  const token = head.appendChild(document.createElement("code"));
  token.textContent = visible(detail.text);
  const figures = [];
  if (detail.k != null) figures.push(`k = ${detail.k}`);
  if (detail.mass != null) figures.push(`kept mass ${percent(detail.mass)}`);
  if (detail.entropy != null) figures.push(`entropy ${detail.entropy.toFixed(2)} nats`);
  figures.push(`p ${percent(Math.exp(detail.logprob))}`);
  const line = card.appendChild(document.createElement("div"));
  line.className = "card-figures";
  line.textContent = figures.join(" · ");
  const list = card.appendChild(document.createElement("ol"));
  list.className = "card-candidates";
  detail.top.forEach((candidate, i) => {
    const item = list.appendChild(document.createElement("li"));
    const bar = item.appendChild(document.createElement("meter"));
    bar.min = 0;
    bar.max = 1;
    bar.value = candidate.p;
    const text = item.appendChild(document.createElement("code"));
    text.textContent = visible(candidate.text);
    item.append(` ${percent(candidate.p)}`);
    if (candidate.text === detail.text) item.className = "chosen";
    // the sampler's cut: the k candidates above it were kept, those below it dropped
    if (i + 1 === detail.k && i + 1 < detail.top.length) {
      list.appendChild(document.createElement("li")).className = "cut";
      list.lastChild.textContent = `cut: the ${detail.k} above kept`;
    }
  });
}

// An SVG plot of k (and entropy, where known) along the reply.
export function plot(details, width = 600, height = 64) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "k-plot");
  svg.setAttribute("role", "img");
  const ks = details.map((d) => d.k).filter((k) => k != null);
  const entropies = details.map((d) => d.entropy).filter((h) => h != null);
  const series = [["k", details.map((d) => d.k), Math.max(...ks, 1)],
                  ["entropy", details.map((d) => d.entropy), Math.max(...entropies, 1e-9)]];
  const step = details.length > 1 ? width / (details.length - 1) : width;
  for (const [name, values, top] of series) {
    const points = values.map((v, i) => (v == null ? null
      : `${(i * step).toFixed(1)},${(height - 2 - (v / top) * (height - 4)).toFixed(1)}`))
      .filter(Boolean);
    if (!points.length) continue;
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", `plot-${name}`);
    svg.append(line);
  }
  const title = document.createElementNS(SVG, "title");
  title.textContent = ks.length
    ? `k along the reply: mean ${(ks.reduce((a, b) => a + b, 0) / ks.length).toFixed(1)}, `
      + `max ${Math.max(...ks)}` : "no k: this sampler does not choose a candidate set";
  svg.append(title);
  svg.setAttribute("aria-label", title.textContent);
  return svg;
}

// The index of the first token where two replies part (their texts differ), or -1 where
// one is the start of the other and they are as long.
export function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i += 1) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}
