"""Load test of `hf-mars serve` on loopback: throughput, latency and accuracy against offered load.

Each server configuration (fixed τ = 1, τ ladders, --lossless) runs as its own `hf-mars serve` process on the
same checkpoint. The capacity of fixed τ = 1 is measured first (a burst of requests, completed requests per
second); then every configuration receives Poisson arrivals at multiples of that capacity, the same prompts in
the same order (the demo's held-out questions), through the official `openai` client with asyncio. Bounded:
`--requests` per level and a timeout per request. Writes JSON and a plot.

    python benchmarks/load_test.py --model runs/demo/mars-checkpoint
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from hf_mars.demo.data import accuracy, generate_examples

CONFIGS = {
    "fixed τ=1": ["--tau-ladder", "0:1.0"],
    "ladder": ["--tau-ladder", "0:1.0,2:0.99"],
    "ladder to 0.95": ["--tau-ladder", "0:1.0,2:0.99,6:0.95"],
    "lossless": ["--lossless"],
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, flags, max_batch_size):
        self.port = _free_port()
        cli = Path(sys.executable).with_name("hf-mars")
        cmd = [str(cli), "serve", model, "--port", str(self.port), "--max-batch-size", str(max_batch_size),
               "--max-queue", "4096", *flags]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                                         max_retries=0, timeout=120)
        self.model = model

    async def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while True:
            try:
                await self.client.models.list()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("server did not start: " + (self.proc.stderr.read() or "")[-2000:])
                await asyncio.sleep(0.5)

    def counter(self, name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.proc.returncode


async def _one(server, example, max_tokens):
    t0 = time.perf_counter()
    try:
        r = await server.client.chat.completions.create(
            model=server.model, messages=[example["messages"][0]], max_tokens=max_tokens, temperature=0)
        return {"ok": True, "id": r.id, "text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
                "start": t0, "end": time.perf_counter()}
    except Exception as e:  # noqa: BLE001 - counted as failed
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "start": t0, "end": time.perf_counter()}


async def run_level(server, examples, rate, max_tokens, seed):
    """Poisson arrivals at ``rate`` requests/s (rate None: one burst); every request awaited."""
    rng = random.Random(seed)
    busy0 = server.counter("hf_mars_decode_seconds_total")
    tasks, t = [], time.perf_counter()
    for ex in examples:
        tasks.append(asyncio.create_task(_one(server, ex, max_tokens)))
        if rate:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
    results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["ok"]]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    busy = server.counter("hf_mars_decode_seconds_total") - busy0
    lat = sorted(r["end"] - r["start"] for r in ok)
    acc = accuracy([ex["task"] for ex in examples], [r.get("text") or "" for r in results],
                   [ex["messages"][1]["content"] for ex in examples])["overall"]
    return {"offered_rps": rate, "requests": len(examples), "answered": len(ok),
            "unique_ids": len({r["id"] for r in ok}), "failed": [r["error"] for r in results if not r["ok"]][:3],
            "throughput_rps": len(ok) / span, "tokens_per_s": sum(r["tokens"] for r in ok) / span,
            "p50_s": lat[len(lat) // 2] if lat else None, "p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
            "decode_utilisation": busy / span, "accuracy": acc, "texts": [r.get("text") for r in results]}


async def main(args):
    examples = generate_examples(args.requests, seed=1, split="eval")
    names = [n.strip() for n in args.configs.split(",")]
    out = {"command": " ".join(sys.argv), "model": args.model, "max_batch_size": args.max_batch_size,
           "max_tokens": args.max_tokens, "configs": {n: CONFIGS[n] for n in names}, "runs": {}}
    # capacity of fixed τ = 1: everything at once, completed requests per second
    server = Server(args.model, CONFIGS["fixed τ=1"], args.max_batch_size)
    try:
        await server.wait_ready()
        await run_level(server, examples[:8], None, args.max_tokens, 0)  # warm-up
        burst = await run_level(server, examples, None, args.max_tokens, 0)
    finally:
        await server.client.close()
        server.stop()
    capacity = burst["throughput_rps"]
    out["capacity_fixed_tau1_rps"] = capacity
    print(f"capacity of fixed τ=1: {capacity:.2f} requests/s", flush=True)
    levels = [float(x) for x in args.levels.split(",")]
    for name in names:
        server = Server(args.model, CONFIGS[name], args.max_batch_size)
        rows = []
        try:
            await server.wait_ready()
            await run_level(server, examples[:8], None, args.max_tokens, 0)
            for i, level in enumerate(levels):
                row = await run_level(server, examples, level * capacity, args.max_tokens, seed=100 + i)
                row["offered_x_capacity"] = level
                rows.append(row)
                print(f"{name:18s} load {level:4.2f}x: {row['throughput_rps']:.2f} req/s, acc "
                      f"{100 * row['accuracy']:.1f}%, p50 {row['p50_s']:.2f}s p95 {row['p95_s']:.2f}s, "
                      f"answered {row['answered']}/{row['requests']}, decoder busy {row['decode_utilisation']:.0%}", flush=True)
        finally:
            await server.client.close()
            rc = server.stop()
        out["runs"][name] = {"levels": rows, "exit_code": rc}
    # answers identical to fixed τ = 1 (greedy) at every level, for the lossless server
    if "lossless" in out["runs"] and "fixed τ=1" in out["runs"]:
        ref = out["runs"]["fixed τ=1"]["levels"]
        out["lossless_identical"] = all(a["texts"] == b["texts"] for a, b in zip(out["runs"]["lossless"]["levels"], ref))
    Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False))
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, run in out["runs"].items():
        xs = [r["offered_x_capacity"] for r in run["levels"]]
        ax1.plot(xs, [r["throughput_rps"] for r in run["levels"]], marker="o", label=name)
        ax2.plot(xs, [100 * r["accuracy"] for r in run["levels"]], marker="o", label=name)
    ax1.set_xlabel("offered load (× capacity of fixed τ=1)")
    ax1.set_ylabel("throughput (requests/s)")
    ax2.set_xlabel("offered load (× capacity of fixed τ=1)")
    ax2.set_ylabel("accuracy on held-out questions (%)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"hf-mars serve on loopback, CPU, batches of ≤{out['max_batch_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64, help="Requests per load level (the same prompts each time).")
    p.add_argument("--levels", default="0.25,0.5,1,2", help="Offered loads, as multiples of fixed τ=1's capacity.")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/load_test.json")
    asyncio.run(main(p.parse_args()))
