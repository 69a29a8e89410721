"""What the chat page costs the browser per streamed token, at 200 tokens/s.

A real `adaptive-llama serve` on the bundled model serves the page to Debian's Chromium
(headless, driven by Playwright). Inside the page, the page's own reply renderer
(web/reply.js, LiveReply) takes synthetic chunks of one token each, with token_details as the
server sends them, at ``--rate`` tokens/s, after ``--history`` tokens of earlier reply (the
cost must not grow with the reply). Three modes, side by side in one run, interleaved:

- ``text``: the page's default view: each token's text added to the reply, whose markdown
  is drawn once a frame (the finished blocks once, the growing one again);
- ``tokens``: each token appended as a span coloured by k (the token view);
- ``redraw``: the whole reply rendered again as markdown at every token (what the page does
  not do), for scale.

One JSON object on stdout: per mode, the mean, 99th percentile and worst time of one
chunk's handling (ms; the browser's clock has a 0.1 ms grain), the rate reached, the worst
gap between two animation frames (layout and paint included: above 50 ms the page
stutters), the cost per token when the same tokens come back to back with one layout after
them (``burst_ms``, and the rate that makes, ``max_tokens_per_s``; against ``text``:
``burst_x_text``), and the time to render the whole reply when it ends. Run it on a quiet
machine.

Beside them, the page's weight: the files the page loads when it opens, in bytes as they
stand in the package (``source_bytes``), as the server sends them (``sent_bytes``: scripts
and style minified) and gzipped, as a browser that takes gzip gets them (``gzip_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

FEED = """async ({mode, rate, tokens, history}) => {
  const { LiveReply, showMessage } = await import('/web/reply.js');
  const words = ['The', ' river', ' runs', ' past', ' the', ' old', ' mill', ',', ' and',
                 ' `code`', ' **bold**', '\\n', '- item', ' with', ' words', '.'];
  const detail = (i) => ({text: words[i % words.length], logprob: -1.2,
    k: 1 + (i * 7) % 40, mass: 0.9, entropy: 1.5,
    top: [0.4, 0.2, 0.1, 0.05, 0.02].map((p, j) => ({text: words[(i + j) % words.length], p}))});
  document.getElementById('messages').replaceChildren();
  const node = document.createElement('div');
  node.className = 'message assistant';
  const content = node.appendChild(document.createElement('div'));
  content.className = 'content';
  document.getElementById('messages').append(node);
  const message = {role: 'assistant', content: ''};
  const live = new LiveReply(content, message, mode === 'tokens');
  for (let i = 0; i < history; i += 1) live.add(detail(i).text, [detail(i)]);
  const gaps = [];
  let last = performance.now(), running = true;
  const frame = (t) => {
    gaps.push(t - last);
    last = t;
    if (running) requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
  const costs = [];
  const start = performance.now();
  for (let i = 0; i < tokens; i += 1) {
    const wait = start + (i * 1000) / rate - performance.now();
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    const d = detail(history + i);
    const t0 = performance.now();
    if (mode === 'redraw') {
      message.content += d.text;
      (message.details ||= []).push(d);
      showMessage(content, message, false);
    } else {
      live.add(d.text, [d]);
    }
    costs.push(performance.now() - t0);
  }
  const elapsed = performance.now() - start;
  await new Promise((resolve) => requestAnimationFrame(() => resolve()));
  running = false;
  // The same tokens again back to back, then one layout: the most the page could take.
  const burstStart = performance.now();
  for (let i = 0; i < tokens; i += 1) {
    const d = detail(history + tokens + i);
    if (mode === 'redraw') {
      message.content += d.text;
      message.details.push(d);
      showMessage(content, message, false);
    } else {
      live.add(d.text, [d]);
    }
  }
  content.getBoundingClientRect();
  const burst = (performance.now() - burstStart) / tokens;
  const t0 = performance.now();
  live.finish();
  const finish = performance.now() - t0;
  return {costs, rate: tokens / elapsed * 1000, worst_frame_ms: Math.max(...gaps),
          burst_ms: burst, finish_ms: finish};
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "serve", "--port",
                             str(port), "--ctx", "256", "--parallel", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not start")


def fetched(url: str, packed: bool) -> bytes:
    headers = {"Accept-Encoding": "gzip"} if packed else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as answer:
        return answer.read()


def page_weight(base: str, urls: list[str]) -> dict:
    """The bytes of the page's own files (``urls``, as it loaded them): in the package,
    as sent, and gzipped."""
    from adaptive_llama.server.web import PAGE_FILES

    names = sorted({url.rsplit("/", 1)[-1] or "index.html" for url in urls
                    if url == base + "/" or url.endswith((".js", ".css"))})
    return {"files": len(names),
            "source_bytes": sum(PAGE_FILES[name].stat().st_size for name in names),
            "sent_bytes": sum(len(fetched(f"{base}/web/{name}", False)) for name in names),
            "gzip_bytes": sum(len(fetched(f"{base}/web/{name}", True)) for name in names)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200, help="tokens per second")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens streamed per run")
    parser.add_argument("--history", type=int, default=2000,
                        help="tokens of reply already shown before the timed ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chromium", default=os.environ.get("ADAPTIVE_LLAMA_CHROMIUM")
                        or shutil.which("chromium"))
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    server = start_server(port)
    modes = ("text", "tokens", "redraw")
    runs = {mode: [] for mode in modes}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1200, "height": 850})
            loaded = []
            page.on("response", lambda response: loaded.append(response.url))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#model option", state="attached")
            weight = page_weight(f"http://127.0.0.1:{port}", loaded)
            for _ in range(args.rounds):
                for mode in modes:
                    # Redrawing is quadratic: fewer tokens keep its run short.
                    tokens = args.tokens if mode != "redraw" else args.tokens // 5
                    runs[mode].append(page.evaluate(FEED, {
                        "mode": mode, "rate": args.rate, "tokens": tokens,
                        "history": args.history}))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = {"rate_asked": args.rate, "tokens": args.tokens, "history": args.history,
           "rounds": args.rounds, "browser": args.chromium, "weight": weight, "modes": {}}
    for mode in modes:
        costs = [c for run in runs[mode] for c in run["costs"]]
        # The browser's clock has a 0.1 ms grain with jitter: the mean of many is the figure.
        out["modes"][mode] = {
            "mean_ms": round(statistics.fmean(costs), 4),
            "p99_ms": round(percentile(costs, 0.99), 3), "worst_ms": round(max(costs), 3),
            "rate": round(statistics.median(r["rate"] for r in runs[mode]), 1),
            "worst_frame_ms": round(max(r["worst_frame_ms"] for r in runs[mode]), 1),
            "burst_ms": round(statistics.median(r["burst_ms"] for r in runs[mode]), 4),
            "finish_ms": round(statistics.median(r["finish_ms"] for r in runs[mode]), 1)}
    base = out["modes"]["text"]["burst_ms"]
    for mode in modes:
        figures = out["modes"][mode]
        figures["max_tokens_per_s"] = round(1000 / figures["burst_ms"]) \
            if figures["burst_ms"] else None
        figures["burst_x_text"] = round(figures["burst_ms"] / base, 2) if base else None
    out["modes"]["redraw"]["tokens"] = args.tokens // 5
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
