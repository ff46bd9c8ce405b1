"""The `hf-mars bench` table: one line per (batch size, configuration), then the step costs, the legend, the
machine and the model."""

from __future__ import annotations

import math

COLUMNS = [
    ("batch", "batch_size", "{:d}"),
    ("mode", "mode", "{}"),
    ("tau", "threshold", "{:g}"),
    ("cache", "cache", "{}"),
    ("rule", "acceptance", "{}"),
    ("tree", "draft_tree", "{}"),
    ("plain", "plain_steps", "{}"),
    ("tok/fwd", "tokens_per_forward", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup_vs_ar", "{:.2f}x"),
    ("(best)", "speedup_min", "{:.2f}x"),
    ("vs best plain", "speedup_vs_best_plain", "{:.2f}x"),
    ("limit", "limit", "{:.2f}x"),
    ("eff", "efficiency", "{:.0%}"),
    ("lim(w)", "limit_w", "{:.2f}x"),
    ("step/c1", "step_cost_vs_1", "{:.2f}"),
    ("ideal", "ideal", "{:.2f}x"),
    ("ovh ms/step", "overhead_ms_per_step", "{:.2f}"),
    ("model ms/step", "model_ms_per_step", "{:.2f}"),
    ("=AR", "matches_ar", "{:.0%}"),
    ("acc", "accuracy", "{:.0%}"),
]


def format_table(result: dict) -> str:
    """A plain-text table of the result rows plus the step costs and the machine."""
    header = [c[0] for c in COLUMNS]
    lines = []
    for row in result["rows"]:
        cells = []
        for _, key, fmt in COLUMNS:
            v = row.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        lines.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    prev_b = None
    for row, cells in zip(result["rows"], lines):
        if prev_b is not None and row["batch_size"] != prev_b:
            out.append("")
        prev_b = row["batch_size"]
        out.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    bsz = result["settings"]["block_size"]
    out += _step_cost_lines(result, bsz)
    out += _legend(result["settings"]["repeats"])
    m = result["machine"]
    out.append(f"machine: {m.get('cpu_model', m['processor'])}, {m['cpu_count']} CPUs, torch threads {m['torch_threads']}, "
               f"device {m['device']}{', ' + m['gpu'] if 'gpu' in m else ''}; load avg {m.get('load_average_start')} -> "
               f"{m.get('load_average_end')}; torch {m['torch']}, transformers {m.get('transformers')}")
    md = result["model"]
    out.append(f"model: {md['class']}, {md['parameters'] / 1e6:.2f}M parameters, hidden {md['hidden_size']}, "
               f"{md['num_hidden_layers']} layers, {md['dtype']}; B={bsz}, max_new_tokens={result['settings']['max_new_tokens']}")
    if md.get("draft_vocab_size"):
        out.append(f"verify rows draft from the checkpoint's saved draft vocabulary ({md['draft_vocab_size']} tokens, "
                   "mars_draft_vocab)")
    if result.get("short_answers"):
        from hf_mars.bench.short_answers import format_short_answers

        out += ["", format_short_answers(result["short_answers"])]
    out += [f"skipped {what}: {why}" for what, why in result["settings"].get("skipped", {}).items()]
    return "\n".join(out)


def _step_cost_lines(result: dict, bsz: int) -> list:
    """The measured step costs per batch size, and the layouts a cost-choosing row picked."""
    past_len = next(iter(result["step_costs"].values()))["past_len"]
    out = ["", f"step costs (one cached forward, cache length ~{past_len}, fastest of the cost repeats):"]
    for b, c in result["step_costs"].items():
        extra = "".join(f", cost({k[5:-3]}) {v:.2f} ms" for k, v in c.items() if k.startswith("cost_") and k not in ("cost_1_ms", f"cost_{1 + bsz}_ms"))
        out.append(f"  batch {b}: cost(1) {c['cost_1_ms']:.2f} ms, cost({1 + bsz}) {c[f'cost_{1 + bsz}_ms']:.2f} ms "
                   f"(ratio {c['ratio']:.2f}){extra}")
    for row in result["rows"]:
        if row.get("policy_layouts"):
            total = sum(row["policy_layouts"].values())
            shares = ", ".join(f"{name} {n / total:.0%}" for name, n in row["policy_layouts"].items())
            auto = row.get("draft_tree") == "auto"
            what = "plain_steps" if row.get("plain_steps") else "'auto'" if auto else "'cost'"
            out.append(f"  batch {row['batch_size']}: {row['mode']} tau={row['threshold']:g} {what} chose per "
                       f"{'call' if auto else 'step'}: {shares}")
    return out


def _legend(repeats: int) -> list:
    """What each column means (printed under the table)."""
    return [
        "speedup: median over repeats of the total time; (best): from each generate call's fastest repeat; "
        f"tok/s and times are medians over {repeats} interleaved repeats",
        "limit = (tokens per forward call, MARS/AR) x cost(1)/cost(1+B); eff = speedup/limit; "
        "lim(w) = the same with the cost of the widths actually forwarded; "
        "ideal = speed-up with zero loop overhead (in-loop model time only); ovh = loop time outside forwards "
        "(- for compiled steps: their forwards are not timed one by one)",
        "rule = threshold mode's mars_acceptance when not the default (probability); plain = threshold mode's "
        "mars_plain_steps (True, the default: a step drops its masks while the wide step's measured cost does not "
        "pay; False: the masks on every step)",
        "tree = verify mode's mars_draft_tree (auto: one draft per depth with masks after every node; chain: "
        "masks after the last draft only; cost: each step's layout chosen by measured cost, the shares above); "
        "step/c1 = a decode step's measured cost over a 1-token step's, at "
        "the widths the run forwarded (a tree is wider: its speed-up is bounded by tok/fwd / step/c1 = lim(w))",
        "=AR = share of answers identical token for token to plain greedy generate's (100% for tau = 1 and "
        "verify); acc = exact-match accuracy against the prompts' reference answers (- without them)",
    ]
