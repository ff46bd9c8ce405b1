"""What `hf-mars demo` writes for people: the per-task and speed tables (``per_task.md``) and ``pareto.png``.

All three read the demo's ``report.json`` dict as written, so they can be redrawn from a saved report. (The Hub
model card's table is `hf_mars.bench.report.BenchmarkReport.card_table`.)
"""

from __future__ import annotations


def _ci(acc: float, ci) -> str:
    text = f"{100 * acc:.1f}%"
    return text if not ci else text + f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"


def per_task_table(report) -> str:
    """Markdown table: rows = tasks (+ overall), columns = AR-SFT, MARS at tau = 1, the chosen tau, verify."""
    chosen = report["chosen_threshold"]
    cols = [("AR-SFT (compute-matched)", "ar_sft", None), ("MARS τ=1.0", "mars", 1.0)]
    if chosen < 1.0:
        cols.append((f"MARS τ={chosen:g}", "mars", chosen))
    if 0.9 not in (c[2] for c in cols):
        cols.append(("MARS τ=0.9", "mars", 0.9))
    cols.append(("MARS verify", "verify", None))
    header = "| task | " + " | ".join(c[0] for c in cols) + " |"
    sep = "|---|" + "---|" * len(cols)
    lines = [header, sep]
    tasks = list(report["per_task"]) + ["overall"]
    for task in tasks:
        cells = []
        for _, kind, tau in cols:
            if task == "overall":
                if kind == "ar_sft":
                    acc, tpf = report["ar_sft"]["accuracy"], None
                elif kind == "verify":
                    acc, tpf = report["verify"]["accuracy"], report["verify"]["tokens_per_forward"]
                else:
                    row = next(r for r in report["mars"] if r["threshold"] == tau)
                    acc, tpf = row["accuracy"], row["tokens_per_forward"]
            else:
                entry = report["per_task"][task]
                if kind == "ar_sft":
                    acc, tpf = entry["ar_sft"], None
                elif kind == "verify":
                    acc, tpf = entry["verify"]["accuracy"], entry["verify"]["tokens_per_forward"]
                else:
                    e = entry["mars"][f"{tau:g}"]
                    acc, tpf = e["accuracy"], e["tokens_per_forward"]
            cells.append(f"{100 * acc:.1f}%" + ("" if tpf is None else f" · {tpf:.2f} tok/fwd"))
        name = f"**{task}**" if task == "overall" else task
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table(report) -> str:
    lines = ["| mode | τ | tokens/forward | accuracy (95% interval) | batch-1 speed-up vs plain generate |",
             "|---|---|---|---|---|"]
    a = report["ar_sft"]
    lines.append(f"| AR-SFT baseline (plain generate) | – | 1.00 | {_ci(a['accuracy'], a.get('accuracy_ci95'))} | – |")
    for r in report["mars"]:
        lines.append(f"| MARS | {r['threshold']:g} | {r['tokens_per_forward']:.2f} | "
                     f"{_ci(r['accuracy'], r.get('accuracy_ci95'))} | {r['speedup_vs_ar']:.2f}× |")
    v = report["verify"]
    lines.append(f"| MARS verify (lossless) | – | {v['tokens_per_forward']:.2f} | "
                 f"{_ci(v['accuracy'], v.get('accuracy_ci95'))} | {v['speedup_vs_ar']:.2f}× |")
    lines += ["", "Tokens per forward and accuracy: each τ with its masks on every step (mars_plain_steps=False) "
                  "and verify with the fixed tree, so they are the same in every run; speed-ups: generate's "
                  "defaults (plain steps where the masks do not pay; verify's 'auto')."]
    paired = report.get("paired_tau1_vs_ar_sft")
    if paired:
        lines += ["", f"MARS τ = 1 against AR-SFT on the same {paired['n']} questions: "
                      f"{100 * paired['difference']:+.1f} points ({paired['only_first_right']} right only with MARS, "
                      f"{paired['only_second_right']} only with AR-SFT); {paired['verdict']}."]
    lines += ["", "| batch size | mode | cache | speed-up vs plain generate |", "|---|---|---|---|"]
    for r in report["batch_speedup"]:
        mode = "verify" if r.get("mode") == "verify" else f"τ={r['threshold']:g}"
        lines.append(f"| {r['batch_size']} | {mode} | {r['cache']} | {r['speedup_vs_ar']:.2f}× |")
    return "\n".join(lines)


def pareto_plot(report, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["mars"], key=lambda r: r["tokens_per_forward"])
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    xs = [r["tokens_per_forward"] for r in rows]
    ys = [100 * r["accuracy"] for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue", label="MARS, threshold τ")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=8)
    v = report["verify"]
    ax.plot([v["tokens_per_forward"]], [100 * v["accuracy"]], "*", color="tab:green", markersize=14,
            label="MARS verify (lossless)")
    ax.axhline(100 * report["ar_sft"]["accuracy"], color="tab:red", linestyle="--",
               label="AR-SFT baseline (compute-matched)")
    finish_plot(fig, ax, "exact-match accuracy, held-out split (%)",
                f"hf-mars demo: tiny Qwen2, B = {report['block_size']}", path)


def finish_plot(fig, ax, ylabel: str, title: str, path) -> None:
    """The demos' accuracy-against-tokens-per-forward plots: axes, grid, legend, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("tokens per forward pass")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

