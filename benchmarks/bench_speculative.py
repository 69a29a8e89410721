"""What speculative decoding does to decode speed, and that it leaves the text as it was.

Three tasks: a code edit (rewrite a 60-line function with one change: the reply copies most
of its prompt), a summary of a given text, and free chat; three samplers: greedy, adaptive
at temperature 0.7 and at 1.0. Each is decoded without drafts ("none"), with prompt lookup
("ngram", the length rule of adaptive_llama.runtime.speculation deciding how much to
draft), and with prompt lookup drafting a fixed number of tokens at every step where it
has them ("fixed-1" to "fixed-16": what the rule is measured against); with
``--draft-model``, also with that model drafting (its rule); and once more without drafts,
in an engine of its own ("control": how far two engines that do the same work differ on
this machine, the floor under which no ratio here means anything). Rounds interleave the
modes, each round starting at another; every reply has the same seed in every mode.

One JSON object on stdout: per task and sampler, the median decode tokens/s of each mode,
its ratio to "none" (the median of each round's ratio: a slow spell of the machine then
slows both sides of a ratio), the share of drafted tokens kept, and whether every mode gave the same
text as "none" in every round; the rule's speed against the best fixed length ("none"
counting as length 0; the median of each round's ratio too, the two modes then making the
same text from the same seed) and against no drafts; and what verifying drafts costs: the median
time of one decode of 1, 2, 4, 8 and 16 rows of one sequence after a 300-token prompt. Run
it on a quiet machine; ``--n-gpu-layers -1`` measures it on a GPU (the GPU kit does, on the
code edit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp

from adaptive_llama import Engine
from adaptive_llama.runtime.chat_template import load_template

FUNCTION = '''def summarize_orders(orders, tax_rate, discounts, currency="EUR"):
    """Totals per customer, with tax and the best discount each customer may use."""
    if not 0 <= tax_rate < 1:
        raise ValueError(f"tax_rate has to be in [0, 1), but is {tax_rate}")
    totals = {}
    counts = {}
    skipped = []
    for order in orders:
        customer = order.get("customer")
        if not customer:
            skipped.append(order)
            continue
        lines = order.get("lines", [])
        if not lines:
            skipped.append(order)
            continue
        subtotal = 0.0
        for line in lines:
            quantity = line.get("quantity", 1)
            price = line.get("price", 0.0)
            if quantity <= 0 or price < 0:
                raise ValueError(f"order {order.get('id')}: bad line {line}")
            subtotal += quantity * price
        codes = order.get("codes", [])
        best = 0.0
        for code in codes:
            rate = discounts.get(code, 0.0)
            if rate > best:
                best = rate
        discounted = subtotal * (1 - best)
        taxed = discounted * (1 + tax_rate)
        totals[customer] = totals.get(customer, 0.0) + taxed
        counts[customer] = counts.get(customer, 0) + 1
    report = []
    for customer in sorted(totals):
        total = round(totals[customer], 2)
        average = round(total / counts[customer], 2)
        report.append({
            "customer": customer,
            "orders": counts[customer],
            "total": total,
            "average": average,
            "currency": currency,
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    if skipped:
        print(f"skipped {len(skipped)} orders without a customer or lines")
    grand_total = round(sum(row["total"] for row in report), 2)
    return {
        "customers": report,
        "grand_total": grand_total,
        "currency": currency,
        "skipped": len(skipped),
    }
'''

ARTICLE = (
    "The Danube is Europe's second-longest river, after the Volga. It rises in the Black "
    "Forest of Germany at the confluence of the Brigach and the Breg, and flows some 2,850 "
    "kilometres to the Black Sea, where it ends in a wide delta in Romania and Ukraine. "
    "Along the way it passes through or borders ten countries: Germany, Austria, Slovakia, "
    "Hungary, Croatia, Serbia, Romania, Bulgaria, Moldova and Ukraine, more than any other "
    "river in the world. Four capital cities lie on its banks: Vienna, Bratislava, Budapest "
    "and Belgrade. For centuries the river was a frontier of the Roman Empire, and later a "
    "main road of trade between central Europe and the East. Today it is linked to the "
    "Rhine and the North Sea by the Main-Danube Canal, so that barges can cross the "
    "continent from Rotterdam to the Black Sea. The Iron Gates, a gorge between Serbia and "
    "Romania, were once feared by sailors; two dams built in the 1970s and 1980s tamed the "
    "current and now produce electricity for both countries. The delta is one of the "
    "largest wetlands in Europe, home to more than 300 species of birds, and a UNESCO World "
    "Heritage Site since 1991. Floods remain a danger: in 2002 and 2013 the river rose to "
    "record levels in Germany, Austria and Hungary, and cities along its banks have since "
    "built new walls and retention areas.")

TASKS = {
    "code_edit": ("Rewrite this function with one change: rename the parameter `discounts` "
                  "to `discount_rates` everywhere. Reply with the whole function in a code "
                  "block and nothing else.\n\n```python\n" + FUNCTION + "```", 700),
    "summary": ("Summarize this text in four sentences, keeping its facts:\n\n" + ARTICLE,
                200),
    "chat": ("What would you take on a week-long hike in the mountains in autumn, and why?",
             200),
}
SAMPLERS = ["greedy", "adaptive:temp=0.7", "adaptive:temp=1.0"]
FIXED = (1, 2, 4, 8, 16)  # the fixed lengths the rule is measured against


def row_costs(engine: Engine, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Milliseconds of one decode of n rows of one sequence (the fed token and n - 1
    drafts), medians, each step timed to its end (llama_synchronize); the rows are taken out
    of the cache again after each. "steady": n rows after n rows; "after one row": n rows
    right after a step of one row, and "one row after": one row right after n rows, as the
    draft rule's steps alternate. On CUDA a batch of another shape than the last resets
    ggml's CUDA-graph warm-up (ggml-cuda.cu), which the steady figures would not show."""
    prompt = engine.tokenize(ARTICLE)[:300]
    engine.clear_cache()
    engine.prefill(prompt)
    decoder, slot = engine.decoder, engine.decoder.slots[0]
    memory = llama_cpp.llama_get_memory(engine.ctx)

    def step(n: int) -> float:
        for j in range(n):
            decoder._put(j, prompt[j], slot, j, True)
        decoder._batch.n_tokens = n
        started = time.perf_counter()
        decoder._decode()
        llama_cpp.llama_synchronize(engine.ctx)
        seconds = time.perf_counter() - started
        llama_cpp.llama_memory_seq_rm(memory, slot.index, len(slot.tokens), -1)
        return seconds

    def ms(times: list[float]) -> float:
        return round(statistics.median(times) * 1000, 2)

    costs = {"steady": {}, "after one row": {}, "one row after": {}}
    for n in (1, 2, 4, 8, 16):
        step(n)  # the shape's first step, not counted
        costs["steady"][str(n)] = ms([step(n) for _ in range(rounds)])
        if n > 1:
            after, before = [], []
            for _ in range(rounds):
                step(1)
                after.append(step(n))
                before.append(step(1))
            costs["after one row"][str(n)] = ms(after)
            costs["one row after"][str(n)] = ms(before)
    engine.clear_cache()
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--fixed", default=",".join(map(str, FIXED)),
                        help="fixed draft lengths to measure the rule against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-rounds", type=int, default=5,
                        help="timed decodes of each shape in decode_ms_by_rows")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per reply (default: each task's own)")
    parser.add_argument("--chat-template", default=None,
                        help="for a model without one: a built-in name (llama.cpp's gemma, ...)")
    parser.add_argument("--n-gpu-layers", type=int, default=0,
                        help="layers on the GPU (-1: all), where a batch of rows costs "
                             "little more than one")
    args = parser.parse_args()
    samplers = args.samplers.split(",")
    options = dict(n_ctx=4096, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
                   chat_template=load_template(args.chat_template) if args.chat_template
                   else None)
    # "none" computes attention as the engines with drafts do, so that texts are comparable
    engines = {"none": Engine(args.model, reference_attention=True, **options),
               "control": Engine(args.model, reference_attention=True, **options),
               "ngram": Engine(args.model, draft="ngram", draft_max=args.draft_max,
                               **options)}
    fixed = {f"fixed-{n}": int(n) for n in args.fixed.split(",")}
    for mode, n in fixed.items():
        engines[mode] = Engine(args.model, draft="ngram", draft_max=max(n, 1), **options)
        engines[mode].decoder.speculation.fixed = n
    if args.draft_model:
        engines["draft-model"] = Engine(args.model, draft=args.draft_model,
                                        draft_max=args.draft_max, **options)
    tasks = args.tasks.split(",")
    runs = {(t, s, m): [] for t in tasks for s in samplers for m in engines}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for task in tasks:
            prompt, max_tokens = TASKS[task]
            max_tokens = args.max_tokens or max_tokens
            for sampler in samplers:
                # each round starts at another mode: no mode always follows the same one
                modes = list(engines)
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                    engine = engines[mode]
                    engine.clear_cache()
                    result = engine.generate(prompt, chat=True, sampler=sampler,
                                             seed=args.seed + r, max_tokens=max_tokens)
                    runs[task, sampler, mode].append(result)
    table = {}
    for task in tasks:
        for sampler in samplers:
            plain = runs[task, sampler, "none"]
            row = {"tokens": statistics.median(x.completion_tokens for x in plain)}
            for mode in engines:
                results = runs[task, sampler, mode]
                rate = statistics.median(x.decode_tokens_per_s for x in results)
                ratio = statistics.median(x.decode_tokens_per_s / p.decode_tokens_per_s
                                          for x, p in zip(results, plain))
                drafted = sum(x.draft_tokens for x in results)
                row[mode] = {
                    "decode_tokens_per_s": round(rate, 2), "ratio": round(ratio, 3),
                    "kept": round(sum(x.draft_accepted for x in results) / drafted, 3)
                    if drafted else None,
                    "drafted_per_reply": round(drafted / len(results), 1),
                    "same_text": all(x.tokens == p.tokens for x, p in zip(results, plain))}
            best = max(["none", *fixed], key=lambda m: row[m]["ratio"])
            paired = statistics.median(
                x.decode_tokens_per_s / b.decode_tokens_per_s
                for x, b in zip(runs[task, sampler, "ngram"], runs[task, sampler, best]))
            row["rule"] = {"best_fixed": best,
                           "vs_best_fixed": round(row["ngram"]["ratio"] / row[best]["ratio"], 3),
                           "vs_best_fixed_paired": round(paired, 3),
                           "vs_none": row["ngram"]["ratio"]}
            table[f"{task} {sampler}"] = row
    print(json.dumps({"benchmark": "speculative", "model": args.model,
                      "draft_model": args.draft_model, "draft_max": args.draft_max,
                      "threads": engines["none"].threads, "rounds": args.rounds,
                      "n_gpu_layers": args.n_gpu_layers,
                      "attention": engines["none"].attention,
                      "decode_ms_by_rows": row_costs(engines["none"], args.row_rounds),
                      "results": table,
                      "rule_worst": {
                          "vs_best_fixed": min(r["rule"]["vs_best_fixed"] for r in table.values()),
                          "vs_best_fixed_paired": min(r["rule"]["vs_best_fixed_paired"]
                                                      for r in table.values()),
                          "vs_none": min(r["rule"]["vs_none"] for r in table.values())},
                      "control_range": [min(r["control"]["ratio"] for r in table.values()),
                                        max(r["control"]["ratio"] for r in table.values())]}))


if __name__ == "__main__":
    main()
