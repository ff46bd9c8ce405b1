"""A short request sent while a long one decodes: does it finish first, and are both answers their answers alone?

For each server (in-flight `hf-mars serve` from `--src`, the static batcher from `--baseline-src`, and with
`--peer-transformers` plain `transformers serve --continuous-batching`), all fixed τ = 1 (greedy), on the same
checkpoint: each request alone first (its answer and latency), then the long request ("Copy: " of a 60-letter
string the demo model answers at length, max_tokens 256 clipped to the context) and `--delay` seconds later the
short one ("Reverse: abc", max_tokens 16); when each finished (seconds after the long one was sent), and whether
each answer equals its answer alone. `--trials` times per server. Servers are started one after the other.

    python benchmarks/short_behind_long.py --model runs/demo/mars-checkpoint --baseline-src ../old \\
        --peer-transformers --out benchmarks/short_behind_long.json
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_test as lt  # the Server class and the source-tree check


async def ask(server, text, max_tokens, t0):
    start = time.perf_counter()
    r = await server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0)
    end = time.perf_counter()
    return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
            "finish_reason": r.choices[0].finish_reason, "sent_s": round(start - t0, 3), "done_s": round(end - t0, 3),
            "latency_s": round(end - start, 3)}


async def probe(name, spec, args, long_max_tokens):
    server = lt.Server(args.model, spec, args.max_batch_size, 600)
    try:
        await server.wait_ready()
        for text in ("Reverse: abc", "Copy: zqzd", "690+940=?"):  # warm-up
            await ask(server, text, 16, time.perf_counter())
        trials = []
        for _ in range(args.trials):
            t0 = time.perf_counter()
            long_alone = await ask(server, args.long_prompt, long_max_tokens, t0)
            t0 = time.perf_counter()
            short_alone = await ask(server, args.short_prompt, args.short_max_tokens, t0)
            load0, probe0 = os.getloadavg()[0], lt.cpu_probe_ms()
            t0 = time.perf_counter()
            long_task = asyncio.create_task(ask(server, args.long_prompt, long_max_tokens, t0))
            await asyncio.sleep(args.delay)
            short = await ask(server, args.short_prompt, args.short_max_tokens, t0)
            long = await long_task
            trial = {"long_alone": long_alone, "short_alone": short_alone, "long": long, "short": short,
                     "short_finished_first": short["done_s"] < long["done_s"],
                     "long_equal_alone": long["text"] == long_alone["text"],
                     "short_equal_alone": short["text"] == short_alone["text"],
                     "loadavg_1m": round(load0, 2), "cpu_probe_ms": probe0}
            trials.append(trial)
            print(f"{name:42s} long alone {long_alone['latency_s']:.2f}s ({long_alone['tokens']} tokens), short alone "
                  f"{short_alone['latency_s']:.2f}s | together: short sent {short['sent_s']:.2f}s done "
                  f"{short['done_s']:.2f}s, long done {long['done_s']:.2f}s -> short first: "
                  f"{trial['short_finished_first']}, equal alone: long {trial['long_equal_alone']} short "
                  f"{trial['short_equal_alone']} (load avg {load0:.2f}, cpu probe {probe0} ms)", flush=True)
        return {"command": server.cmd, "imports": spec.get("imports"), "trials": trials}
    finally:
        await server.client.close()
        server.stop()


async def main(args):
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.long_prompt}], add_generation_prompt=True,
                                   tokenize=False)
    context = AutoConfig.from_pretrained(args.model).max_position_embeddings
    long_max_tokens = min(args.long_max_tokens, context - len(tok(text, add_special_tokens=False)["input_ids"]))
    tau1 = lt.CONFIGS["fixed τ=1"]
    specs = {"in-flight (fixed τ=1)": {"kind": "hf-mars", "tree": "in-flight", "src": args.src, "flags": tau1}}
    if args.baseline_src:
        specs["static (fixed τ=1)"] = {"kind": "hf-mars", "tree": "static", "src": args.baseline_src, "flags": tau1}
    if args.peer_transformers:
        specs["transformers serve --continuous-batching"] = {"kind": "transformers", "tree": "transformers",
                                                             "flags": ["--continuous-batching"]}
    for spec in specs.values():
        if spec["kind"] == "hf-mars":
            spec["imports"] = lt._imports_from(spec["src"])
    out = {"command": " ".join(sys.argv), "model": args.model, "long_prompt": args.long_prompt,
           "long_max_tokens": long_max_tokens, "short_prompt": args.short_prompt,
           "short_max_tokens": args.short_max_tokens, "delay_s": args.delay, "servers": {}}
    for name, spec in specs.items():
        try:
            out["servers"][name] = await probe(name, spec, args, long_max_tokens)
        except Exception as e:  # noqa: BLE001 - recorded
            out["servers"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: failed: {e}", flush=True)
    for name, res in out["servers"].items():
        if "trials" in res:
            t = res["trials"]
            res["summary"] = {"short_finished_first": sum(x["short_finished_first"] for x in t),
                              "long_equal_alone": sum(x["long_equal_alone"] for x in t),
                              "short_equal_alone": sum(x["short_equal_alone"] for x in t), "trials": len(t),
                              "short_done_s": [x["short"]["done_s"] for x in t],
                              "long_done_s": [x["long"]["done_s"] for x in t]}
            print(f"{name}: {res['summary']}")
    Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--src", type=Path, default=lt.TREE, help="Source tree of the in-flight server (PYTHONPATH).")
    p.add_argument("--baseline-src", type=Path, default=None, help="Source tree of the static batcher.")
    p.add_argument("--peer-transformers", action="store_true")
    p.add_argument("--long-prompt", default="Copy: " + "ab" * 30)
    p.add_argument("--long-max-tokens", type=int, default=256, help="Clipped to the model's context.")
    p.add_argument("--short-prompt", default="Reverse: abc")
    p.add_argument("--short-max-tokens", type=int, default=16)
    p.add_argument("--delay", type=float, default=0.3, help="Seconds between the long and the short request.")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--out", default="benchmarks/short_behind_long.json")
    asyncio.run(main(p.parse_args()))
