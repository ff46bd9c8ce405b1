"""Load test of `hf-mars serve` on loopback: throughput, latency and accuracy against offered load.

Each server configuration (fixed τ = 1, τ ladders, --lossless) runs as its own `hf-mars serve` process on the
same checkpoint, from a given source tree (PYTHONPATH=<tree>, checked by importing `hf_mars` with that
environment): the in-flight configurations from `--src` (default: the tree holding this script), and with
`--baseline-src PATH` the same configurations of another tree (e.g. a worktree of the static batcher) beside
them, named "static ...". `--peer-transformers` adds plain `transformers serve --continuous-batching` on the
same checkpoint (plain greedy decoding) as the peer a user would pick; if it cannot serve, the error is recorded
and `transformers serve` without continuous batching runs instead, labelled so.

All servers start first and stay up (idle, they use no CPU). The capacity of the in-flight fixed τ = 1 server is
measured once (`--capacity-bursts` bursts of the workload's requests, the median of completed requests per
second); then, level by level, every configuration in turn receives Poisson arrivals at that multiple of the
capacity, the same requests in the same order with the same arrival times, through the official `openai` client
with asyncio. `--repeats R` does this R times, the order of the configurations rotated each time, and the table
shows medians: on a shared machine, contention from outside then falls on every configuration alike (each row
records the 1-minute load average and a fixed CPU probe's milliseconds).
Workloads: `short` (the demo's held-out questions) or `mix` (the same, with every `--long-every`-th request
replaced by a long answer: "Copy: " of a 60-80 letter string the demo model answers at length, max_tokens
`--long-max-tokens` clipped to the model's context). Bounded: `--requests` per level and a timeout per request.
Prints a table and writes JSON and a plot; for each row, how many answers are identical to the fixed τ = 1 run
of the same tree and to the in-flight fixed τ = 1 run (same level, same request).

    python benchmarks/load_test.py --model runs/demo/mars-checkpoint
    python benchmarks/load_test.py --model runs/demo/mars-checkpoint --baseline-src ../old --peer-transformers \\
        --levels 1,2 --requests 96 --workload mix --out benchmarks/load_test_inflight_mix.json
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from hf_mars.bench.tasks import accuracy, generate_examples

CONFIGS = {
    "fixed τ=1": ["--tau-ladder", "0:1.0"],
    "ladder": ["--tau-ladder", "0:1.0,2:0.99"],
    "ladder to 0.95": ["--tau-ladder", "0:1.0,2:0.99,6:0.95"],
    "lossless": ["--lossless"],  # verify; its default layout measured per step (`generation.engine.measured_step`)
    "lossless tree": ["--lossless", "--mars-draft-tree", "tree"],  # the fixed layouts it chooses between
    "lossless chain": ["--lossless", "--mars-draft-tree", "chain"],
}
# "Copy: " of these, the demo checkpoint answers at length (it runs to the token limit); other 60-80 letter
# strings, e.g. random letters, get answers of ~10 tokens. The mean completion tokens of long and short requests
# are printed and recorded, so a checkpoint that answers them briefly shows.
LONG_STRINGS = ["ab" * 30, "ba" * 30, "cd" * 30, "bc" * 30, "aab" * 20, "ab" * 31, "ab" * 40]
TREE = Path(__file__).resolve().parents[1]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _imports_from(src):
    """The hf_mars package a process started with PYTHONPATH=src imports (checked, not assumed)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", "import hf_mars; print(hf_mars.__file__)"], env=env, cwd=src,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(Path(src).resolve()):
        raise RuntimeError(f"PYTHONPATH={src} imports hf_mars from {out}, not from that tree")
    return out


class Server:
    """One server process: `hf-mars serve` from a source tree, or `transformers serve` (kind "transformers")."""

    def __init__(self, model, spec, max_batch_size, timeout):
        self.port = _free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if spec["kind"] == "transformers":
            cli = Path(sys.executable).with_name("transformers")
            cmd = [str(cli), "serve", *spec["flags"], "--host", "127.0.0.1", "--port", str(self.port), model]
        else:
            env["PYTHONPATH"] = str(spec["src"])
            cmd = [sys.executable, "-m", "hf_mars", "serve", model, "--port", str(self.port),
                   "--max-batch-size", str(max_batch_size), "--max-queue", "4096", *spec["flags"]]
        self.cmd = cmd
        # stderr to a file, not a pipe: a chatty server (uvicorn logs each request) would block on a full pipe
        self.log = tempfile.NamedTemporaryFile("w+", prefix="load_test_", suffix=".log", delete=False)  # noqa: SIM115
        # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
        self.proc = subprocess.Popen(cmd, env=env, cwd=spec.get("src") or tempfile.gettempdir(), stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)
        self.client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                                         max_retries=0, timeout=timeout)
        self.model = model
        self.has_metrics = spec["kind"] != "transformers"

    def log_tail(self, n=3000):
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    async def wait_ready(self, timeout=180):
        deadline = time.time() + timeout
        while True:
            try:
                await self.client.models.list()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("server did not start: " + self.log_tail())
                await asyncio.sleep(0.5)

    def counter(self, name):
        if not self.has_metrics:
            return None
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode


def build_workload(args):
    """The requests of one level: the demo's held-out questions, with every ``long_every``-th replaced by a long
    answer under ``--workload mix`` (deterministic: the same positions and prompts on every run)."""
    examples = generate_examples(args.requests, seed=1, split="eval")
    items = [{"messages": [ex["messages"][0]], "task": ex["task"], "reference": ex["messages"][1]["content"],
              "max_tokens": args.max_tokens, "long": False} for ex in examples]
    if args.workload == "mix":
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        context = AutoConfig.from_pretrained(args.model).max_position_embeddings
        for j, i in enumerate(range(args.long_every - 1, len(items), args.long_every)):
            s = LONG_STRINGS[j % len(LONG_STRINGS)]
            messages = [{"role": "user", "content": "Copy: " + s}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
            # the servers refuse prompt + max_tokens beyond the context (400 context_length_exceeded)
            items[i] = {"messages": messages, "task": "copy", "reference": s, "long": True,
                        "max_tokens": min(args.long_max_tokens, context - prompt_tokens)}
    return items


async def _one(server, item):
    t0 = time.perf_counter()
    try:
        r = await server.client.chat.completions.create(
            model=server.model, messages=item["messages"], max_tokens=item["max_tokens"], temperature=0)
        return {"ok": True, "id": r.id, "text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
                "start": t0, "end": time.perf_counter()}
    except Exception as e:  # noqa: BLE001 - counted as failed
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "start": t0, "end": time.perf_counter()}


def _p(sorted_values, q):
    return sorted_values[int(q * (len(sorted_values) - 1))] if sorted_values else None


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


async def run_level(server, items, rate, seed):
    """Poisson arrivals at ``rate`` requests/s (rate None: one burst); every request awaited."""
    rng = random.Random(seed)
    load0 = os.getloadavg()[0]
    busy0 = server.counter("hf_mars_decode_seconds_total")
    tasks, t = [], time.perf_counter()
    for item in items:
        tasks.append(asyncio.create_task(_one(server, item)))
        if rate:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
    results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["ok"]]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    busy = server.counter("hf_mars_decode_seconds_total")
    lat = sorted(r["end"] - r["start"] for r in ok)
    lat_short = sorted(r["end"] - r["start"] for r, it in zip(results, items) if r["ok"] and not it["long"])
    lat_long = sorted(r["end"] - r["start"] for r, it in zip(results, items) if r["ok"] and it["long"])
    acc = accuracy([it["task"] for it in items], [r.get("text") or "" for r in results],
                   [it["reference"] for it in items])["overall"]
    return {"offered_rps": rate, "requests": len(items), "answered": len(ok), "lost": len(items) - len(ok),
            "unique_ids": len({r["id"] for r in ok}), "failed": [r["error"] for r in results if not r["ok"]][:3],
            "throughput_rps": len(ok) / span, "tokens_per_s": sum(r["tokens"] for r in ok) / span,
            "p50_s": _p(lat, 0.5), "p95_s": _p(lat, 0.95), "p95_short_s": _p(lat_short, 0.95),
            "p95_long_s": _p(lat_long, 0.95),
            "mean_tokens_short": _mean([r["tokens"] for r, it in zip(results, items) if r["ok"] and not it["long"]]),
            "mean_tokens_long": _mean([r["tokens"] for r, it in zip(results, items) if r["ok"] and it["long"]]),
            "decode_utilisation": None if busy is None else (busy - busy0) / span, "accuracy": acc,
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "span_s": span,
            "texts": [r.get("text") for r in results]}


def build_specs(args):
    """The hf-mars configurations to run: in-flight (``--src``), then static (``--baseline-src``)."""
    specs = {}
    for n in (x.strip() for x in args.configs.split(",")):
        specs[n] = {"kind": "hf-mars", "tree": "in-flight", "src": args.src, "flags": CONFIGS[n], "base": n}
    if args.baseline_src:
        for n in (x.strip() for x in args.baseline_configs.split(",")):
            specs["static " + n] = {"kind": "hf-mars", "tree": "static", "src": args.baseline_src,
                                    "flags": CONFIGS[n], "base": n}
    return specs


def cpu_probe_ms():
    """Milliseconds of a fixed small matmul loop (what the servers do) in this process: rises when the cores are
    contended, from this machine or from outside it (a shared host: see also the steal ticks)."""
    import torch

    x, w = torch.ones(8, 512), torch.ones(512, 512)
    t = time.perf_counter()
    for _ in range(300):
        x @ w
    return round(1000 * (time.perf_counter() - t), 1)


def _steal_ticks():
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])


def _cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_server(name, spec, args, items):
    """Start, wait until it answers, warm up; raise with the server's log if it cannot answer."""
    server = Server(args.model, spec, args.max_batch_size, args.timeout)
    try:
        await server.wait_ready()
        warm = await run_level(server, items[:8], None, 0)
        if warm["answered"] == 0:
            raise RuntimeError(f"no warm-up request answered: {warm['failed']}; server log: {server.log_tail()}")
    except BaseException:
        await server.client.close()
        server.stop()
        raise
    print(f"started {name}: {' '.join(server.cmd)}", flush=True)
    return server


async def start_peer(args, items, out):
    """`transformers serve --continuous-batching` on the checkpoint; on failure, record why and run without."""
    spec = {"kind": "transformers", "tree": "transformers", "flags": ["--continuous-batching"], "base": None}
    try:
        return "transformers serve --continuous-batching", spec, await start_server("peer", spec, args, items)
    except Exception as e:  # noqa: BLE001 - recorded, then the fallback peer
        out["peer_continuous_batching_error"] = f"{type(e).__name__}: {e}"
        print(f"transformers serve --continuous-batching failed: {e}\n-> fallback without it", flush=True)
    spec = {"kind": "transformers", "tree": "transformers", "flags": ["--no-continuous-batching"], "base": None}
    return "transformers serve (no CB, fallback)", spec, await start_server("peer", spec, args, items)


async def measure(server, items, rate, seed):
    probe, cpu0, steal0 = cpu_probe_ms(), _cpu_seconds(server.proc.pid), _steal_ticks()
    row = await run_level(server, items, rate, seed)
    row["cpu_probe_ms"] = probe
    row["server_cpu_s"] = round(_cpu_seconds(server.proc.pid) - cpu0, 2)
    row["steal_ticks"] = _steal_ticks() - steal0
    return row


def _same(a, b):
    """Requests answered by both with identical texts."""
    return sum(x is not None and x == y for x, y in zip(a["texts"], b["texts"]))


def compare_texts(out):
    """Per repeat and level: answers identical to the fixed τ = 1 run of the same tree, and to in-flight τ = 1."""
    runs = out["runs"]
    new_ref = next((n for n, r in runs.items() if r["tree"] == "in-flight" and r["base"] == "fixed τ=1"), None)
    for name, run in runs.items():
        tree_ref = next((n for n, r in runs.items() if r["tree"] == run["tree"] and r["base"] == "fixed τ=1"), None)
        for rep, rows in enumerate(run["repeats"]):
            for i, row in enumerate(rows):
                if tree_ref and tree_ref != name:
                    row["identical_to_tree_tau1"] = _same(row, runs[tree_ref]["repeats"][rep][i])
                if new_ref and new_ref != name:
                    row["identical_to_inflight_tau1"] = _same(row, runs[new_ref]["repeats"][rep][i])
                elif new_ref:  # in-flight τ = 1 itself: its answers do not depend on the load (batch company)
                    row["identical_to_capacity_burst"] = _same(row, {"texts": out["capacity_burst_texts"]})
    # back-compat key: answers identical to fixed τ = 1 (greedy) at every level, for the lossless server
    if "lossless" in runs and "fixed τ=1" in runs:
        out["lossless_identical"] = all(a["texts"] == b["texts"] for ra, rb in
                                        zip(runs["lossless"]["repeats"], runs["fixed τ=1"]["repeats"])
                                        for a, b in zip(ra, rb))


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def aggregate(rows):
    """One row from the repeats of a level: medians of rates and latencies, sums of counts."""
    agg = {"offered_x_capacity": rows[0]["offered_x_capacity"], "offered_rps": rows[0]["offered_rps"],
           "repeats": len(rows)}
    for k in ("throughput_rps", "tokens_per_s", "p50_s", "p95_s", "p95_short_s", "p95_long_s", "accuracy",
              "mean_tokens_short", "mean_tokens_long", "decode_utilisation", "cpu_probe_ms", "server_cpu_s",
              "steal_ticks"):
        agg[k] = _median([r[k] for r in rows])
    agg["p95_s_range"] = [min(r["p95_s"] for r in rows if r["p95_s"] is not None),
                          max(r["p95_s"] for r in rows if r["p95_s"] is not None)] if any(
        r["p95_s"] is not None for r in rows) else None
    agg["throughput_rps_range"] = [min(r["throughput_rps"] for r in rows), max(r["throughput_rps"] for r in rows)]
    for k in ("requests", "answered", "lost", "unique_ids", "identical_to_tree_tau1", "identical_to_inflight_tau1",
              "identical_to_capacity_burst"):
        if k in rows[0]:
            agg[k] = sum(r[k] for r in rows)
    agg["failed"] = [e for r in rows for e in r["failed"]][:3]
    agg["loadavg_1m"] = [min(r["loadavg_1m"][0] for r in rows), max(r["loadavg_1m"][1] for r in rows)]
    return agg


def table(out):
    mix = out["workload"] == "mix"
    head = (f"{'configuration':40s} {'load':>4s} {'req/s':>6s} {'tok/s':>6s} {'p50 s':>6s} {'p95 s':>6s} "
            f"{'p95 range':>11s} " + (f"{'p95sh':>6s} " if mix else "") + f"{'answered':>9s} {'lost':>4s} "
            f"{'=τ1 tree':>9s} {'=new τ1':>9s} {'loadavg':>9s}")
    lines = [head, "-" * len(head)]

    def f(x, w, d=2):
        return f"{x:{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"

    for name, run in out["runs"].items():
        for row in run["levels"]:
            n = row["requests"]
            t1 = row.get("identical_to_tree_tau1")
            nt1 = row.get("identical_to_inflight_tau1", row.get("identical_to_capacity_burst"))
            rng = row["p95_s_range"]
            lines.append(
                f"{name:40s} {row['offered_x_capacity']:3.1f}x {f(row['throughput_rps'], 6)} "
                f"{f(row['tokens_per_s'], 6, 0)} {f(row['p50_s'], 6)} {f(row['p95_s'], 6)} "
                f"{(f'{rng[0]:.2f}-{rng[1]:.2f}' if rng else '-'):>11s} "
                + (f"{f(row['p95_short_s'], 6)} " if mix else "")
                + f"{row['answered']:>4d}/{n:<4d} {row['lost']:>4d} "
                f"{(f'{t1}/{n}' if t1 is not None else '-'):>9s} {(f'{nt1}/{n}' if nt1 is not None else '-'):>9s} "
                f"{row['loadavg_1m'][0]:4.1f}-{row['loadavg_1m'][1]:<4.1f}")
    lines.append("(medians over repeats; answered, lost and identical counts summed over repeats; =new τ1 of the"
                 " in-flight τ=1 row itself: identical to its capacity burst)")
    return "\n".join(lines)


async def main(args):
    if Path(args.model).exists():  # the servers run in other directories
        args.model = str(Path(args.model).resolve())
    items = build_workload(args)
    specs = build_specs(args)
    for spec in specs.values():
        spec["imports"] = _imports_from(spec["src"])
    out = {"command": " ".join(sys.argv), "model": args.model, "max_batch_size": args.max_batch_size,
           "max_tokens": args.max_tokens, "workload": args.workload, "requests": len(items),
           "repeats": args.repeats, "long_requests": [i for i, it in enumerate(items) if it["long"]],
           "long_max_tokens": sorted({it["max_tokens"] for it in items if it["long"]}),
           "src": str(args.src), "baseline_src": str(args.baseline_src) if args.baseline_src else None,
           "configs": {n: s["flags"] for n, s in specs.items()}, "loadavg_start": os.getloadavg(),
           "cpu_probe_ms_start": cpu_probe_ms(), "runs": {}}
    print(f"workload {args.workload}: {len(items)} requests, {len(out['long_requests'])} long (max_tokens "
          f"{out['long_max_tokens']}); imports: " + "; ".join(f"{n}: {s['imports']}" for n, s in specs.items()),
          flush=True)
    # every server stays up for the whole run (idle, they use no CPU) so that the configurations of a level are
    # measured one after the other, in an order rotated each repeat: contention from outside hits them alike
    servers = {}
    try:
        for name, spec in specs.items():
            servers[name] = await start_server(name, spec, args, items)
        if "fixed τ=1" not in servers:
            spec = {"kind": "hf-mars", "tree": "in-flight", "src": args.src, "flags": CONFIGS["fixed τ=1"],
                    "base": "fixed τ=1", "imports": _imports_from(args.src)}
            servers["(capacity) fixed τ=1"] = await start_server("capacity", spec, args, items)
        cap_server = servers.get("fixed τ=1") or servers["(capacity) fixed τ=1"]
        if args.peer_transformers:
            name, spec, server = await start_peer(args, items, out)
            specs[name], servers[name] = spec, server
        # capacity of the in-flight fixed τ = 1 server: the whole workload at once, completed requests per second
        bursts = [await measure(cap_server, items, None, 0) for _ in range(args.capacity_bursts)]
        capacity = _median([b["throughput_rps"] for b in bursts])
        out["capacity_fixed_tau1_rps"] = capacity
        out["capacity_bursts"] = [{k: v for k, v in b.items() if k != "texts"} for b in bursts]
        out["capacity_burst_texts"] = bursts[0]["texts"]
        print(f"capacity of in-flight fixed τ=1 ({args.workload}): {capacity:.2f} requests/s (median of "
              f"{[round(b['throughput_rps'], 2) for b in bursts]}), {bursts[0]['answered']}/{bursts[0]['requests']} "
              f"answered; mean completion tokens: short {bursts[0]['mean_tokens_short']}, long "
              f"{bursts[0]['mean_tokens_long']}", flush=True)
        levels = [float(x) for x in args.levels.split(",")]
        names = list(specs)
        reps = {n: [[None] * len(levels) for _ in range(args.repeats)] for n in names}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for i, level in enumerate(levels):
                for name in order:
                    row = await measure(servers[name], items, level * capacity, seed=100 + i)
                    row["offered_x_capacity"] = level
                    reps[name][rep][i] = row
                    util = "" if row["decode_utilisation"] is None else f", busy {row['decode_utilisation']:.0%}"
                    print(f"[{rep}] {name:38s} {level:4.2f}x: {row['throughput_rps']:.2f} req/s, acc "
                          f"{100 * row['accuracy']:.1f}%, p50 {row['p50_s']:.2f}s p95 {row['p95_s']:.2f}s, "
                          f"answered {row['answered']}/{row['requests']}{util}, load avg {row['loadavg_1m']}, "
                          f"cpu probe {row['cpu_probe_ms']} ms, server cpu {row['server_cpu_s']} s, "
                          f"steal {row['steal_ticks']}", flush=True)
    finally:
        codes = {}
        for name, server in servers.items():
            await server.client.close()
            codes[name] = server.stop()
    for name in names:
        spec = specs[name]
        out["runs"][name] = {"kind": spec["kind"], "tree": spec["tree"], "base": spec["base"],
                             "src": str(spec["src"]) if spec.get("src") else None, "imports": spec.get("imports"),
                             "flags": spec["flags"], "command": servers[name].cmd, "exit_code": codes[name],
                             "repeats": reps[name]}
    compare_texts(out)
    for run in out["runs"].values():
        run["levels"] = [aggregate([rows[i] for rows in run["repeats"]]) for i in range(len(levels))]
    out["loadavg_end"] = os.getloadavg()
    out["cpu_probe_ms_end"] = cpu_probe_ms()
    out["table"] = table(out)
    print(out["table"])
    Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False))
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, run in out["runs"].items():
        xs = [r["offered_x_capacity"] for r in run["levels"]]
        style = {"in-flight": "-", "static": "--", "transformers": ":"}[run["tree"]]
        axes[0].plot(xs, [r["throughput_rps"] for r in run["levels"]], style, marker="o", label=name)
        axes[1].plot(xs, [r["p95_s"] for r in run["levels"]], style, marker="o", label=name)
        axes[2].plot(xs, [100 * r["accuracy"] for r in run["levels"]], style, marker="o", label=name)
    for ax, ylabel in zip(axes, ["throughput (requests/s)", "p95 latency (s)", "accuracy on the requests (%)"]):
        ax.set_xlabel("offered load (× capacity of in-flight fixed τ=1)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"hf-mars serve on loopback, CPU, batches of ≤{out['max_batch_size']}, workload {out['workload']}"
                 f" (capacity {out['capacity_fixed_tau1_rps']:.1f} req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64, help="Requests per load level (the same prompts each time).")
    p.add_argument("--levels", default="0.25,0.5,1,2", help="Offered loads, as multiples of fixed τ=1's capacity.")
    p.add_argument("--configs", default="fixed τ=1,ladder,ladder to 0.95,lossless",
                   help=f"In-flight configurations (from --src), of {list(CONFIGS)}.")
    p.add_argument("--src", type=Path, default=TREE, help="Source tree of the in-flight servers (PYTHONPATH).")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="Source tree of the static batcher; adds its --baseline-configs as 'static ...' rows.")
    p.add_argument("--baseline-configs", default="fixed τ=1,lossless")
    p.add_argument("--peer-transformers", action="store_true",
                   help="Also run `transformers serve --continuous-batching` on the checkpoint (plain greedy).")
    p.add_argument("--workload", choices=["short", "mix"], default="short")
    p.add_argument("--long-every", type=int, default=8, help="mix: every k-th request is a long answer.")
    p.add_argument("--long-max-tokens", type=int, default=256, help="mix: max_tokens of a long answer "
                                                                     "(clipped to the context).")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1,
                   help="Rounds over every configuration and level (config order rotated each round); the table "
                        "shows medians.")
    p.add_argument("--capacity-bursts", type=int, default=1, help="Bursts measuring capacity (median).")
    p.add_argument("--timeout", type=float, default=600, help="Seconds per request before it counts as lost.")
    p.add_argument("--out", default="benchmarks/load_test.json")
    asyncio.run(main(p.parse_args()))
