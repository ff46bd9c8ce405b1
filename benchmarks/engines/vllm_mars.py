"""MARS inside vLLM against plain vLLM and vLLM's `ngram`, on one machine, one run, the same prompts.

For each engine setting one OpenAI-compatible vLLM server is started (in this script's environment, which must
have vLLM and hf-mars installed: the plugin makes {"method": "mars"} available) and the demo's 192 held-out
questions are sent: one request at a time, all at once (a burst), and as Poisson arrivals at 0.5, 1 and 2 times
plain vLLM's burst throughput (`mars_ladder` is MARS with `batch_ladder`: fewer masks in large batches;
`mars_tau0.9` sends each request's own `mars_threshold` 0.9 through `vllm_xargs`; `mars_tau_ladder` is threshold
mode by load, lossless below 4 requests in a step). Per
scenario: mean acceptance length (tokens per target forward over the steps that drafted, from vLLM's own
`vllm:spec_decode_*` counters), requests/s, completion tokens/s (threshold mode may change how long answers
are), p50/p95 latency, accuracy, requests lost (and why), and how many answers equal plain vLLM's (greedy:
lossless means all).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/engines/vllm_mars.py --model /path/to/mars-checkpoint \
        --out benchmarks/engines/vllm_mars.json

Servers run one after another, so on a shared machine their ratios carry its drift. ``--interleaved N`` times
plain vLLM against MARS in one process instead (two offline engines; each ``--thresholds`` tau through the same
MARS engine, ``-1`` for lossless), in turn, N times: a burst of every question, then the first
``--one-at-a-time`` questions one by one; medians, ratios against plain taken in the same round:

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/engines/vllm_mars.py --model /path/to/mars-checkpoint \
        --interleaved 3 --out benchmarks/engines/vllm_threshold.json
"""

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openai import AsyncOpenAI

_spec = importlib.util.spec_from_file_location("bundled_tasks", Path(__file__).parents[2] / "hf_mars/bench/tasks.py")
data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data)

SETTINGS = {  # name -> --speculative-config (None: plain)
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "mars": {"method": "mars"},
    # B by the number of requests in a step: B = 4 up to 3, 2 up to 11, plain steps from 12 (vLLM's dynamic SD)
    "mars_ladder": {"method": "mars", "speculator_options": {"batch_ladder": "1:4,4:2,12:0"}},
    "mars_tau0.9": {"method": "mars"},
    # threshold mode by the number of requests in a step: lossless up to 3, tau 0.95 from 4, 0.9 from 12
    "mars_tau_ladder": {"method": "mars", "speculator_options": {"tau_ladder": "0:1.0,4:0.95,12:0.9"}},
}
XARGS = {"mars_tau0.9": {"mars_threshold": 0.9}}  # name -> each request's vllm_xargs


def start_server(model, port, spec, log):
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--max-model-len", "256", "--port", str(port), "--host", "127.0.0.1", "--seed", "0"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError("server did not start in 600 s")


def spec_counters(port) -> tuple[float, float]:
    """(drafting steps, accepted tokens) from vLLM's Prometheus counters (0, 0 without speculation)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def total(name):
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M))

    return total("spec_decode_num_drafts"), total("spec_decode_num_accepted_tokens")


async def scenario(client, model, port, examples, arrivals, xargs=None):
    """Send every example, the i-th at arrivals[i] seconds (None: one at a time, each after the last answer)."""
    drafts0, accepted0 = spec_counters(port)

    async def one(example, delay):
        await asyncio.sleep(delay)
        t = time.perf_counter()
        try:
            r = await client.chat.completions.create(model=model, messages=[example["messages"][0]],
                                                     temperature=0, max_tokens=64,
                                                     extra_body={"vllm_xargs": xargs} if xargs else None)
            return r.choices[0].message.content, time.perf_counter() - t, r.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - a lost request is a result here
            return e, time.perf_counter() - t, 0

    start = time.perf_counter()
    if arrivals is None:
        results = [await one(e, 0) for e in examples]
    else:
        results = await asyncio.gather(*(one(e, a) for e, a in zip(examples, arrivals)))
    seconds = time.perf_counter() - start
    drafts, accepted = (b - a for a, b in zip((drafts0, accepted0), spec_counters(port)))
    texts = [r if isinstance(r, str) else None for r, _, _ in results]
    lat = sorted(s for _, s, _ in results)
    tokens = sum(n for _, _, n in results)
    ok = [t for t in texts if t is not None]
    acc = data.accuracy([e["task"] for e in examples], [t or "" for t in texts],
                        [e["messages"][1]["content"] for e in examples])["overall"]
    return {"acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "requests_per_s": round(len(examples) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "completion_tokens": tokens, "p50_s": round(statistics.median(lat), 4),
            "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4), "accuracy": acc,
            "lost": len(examples) - len(ok), "texts": texts,
            "lost_because": sorted({f"{type(r).__name__}: {r}"[:200] for r, _, _ in results if not isinstance(r, str)})}


def poisson(rate, n, seed):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_setting(name, args, capacity):
    port = args.port
    with open(Path(args.logs) / f"vllm_{name}.log", "w") as log:
        proc = start_server(args.model, port, SETTINGS[name], log)
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        try:
            examples = data.generate_examples(args.requests, seed=1, split="eval")
            xargs = XARGS.get(name)
            await scenario(client, args.model, port, examples[:8], None, xargs)  # warm-up, not counted
            out = {"one_at_a_time": await scenario(client, args.model, port, examples, None, xargs),
                   "burst": await scenario(client, args.model, port, examples, [0.0] * len(examples), xargs)}
            capacity = capacity or out["burst"]["requests_per_s"]
            for factor in (0.5, 1.0, 2.0):
                arrivals = poisson(factor * capacity, len(examples), seed=int(factor * 10))
                out[f"poisson_{factor:g}x"] = await scenario(client, args.model, port, examples, arrivals, xargs)
            return out, capacity
        finally:
            await client.close()
            proc.terminate()
            proc.wait(timeout=60)


async def main(args):
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    results, capacity = {}, None
    for name in args.settings:
        results[name], capacity = await run_setting(name, args, capacity)
        print(name, {k: {m: v for m, v in r.items() if m != "texts"} for k, r in results[name].items()}, flush=True)
    for name in results:
        for key, r in results[name].items():
            base = results["plain"][key]["texts"]
            r["same_as_plain"] = sum(a == b and a is not None for a, b in zip(r["texts"], base))
    report = {"command": " ".join(["python"] + sys.argv), "model": args.model, "requests": args.requests,
              "plain_capacity_requests_per_s": capacity, "settings": {k: SETTINGS[k] for k in results},
              "request_args": {k: XARGS[k] for k in results if k in XARGS},
              "results": {n: {k: {m: v for m, v in r.items() if m != "texts"} for k, r in res.items()}
                          for n, res in results.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["results"], indent=1))


def interleaved(args):
    """``--interleaved`` (module docstring)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    examples = data.generate_examples(args.requests, seed=1, split="eval")
    prompts = [tok.apply_chat_template([e["messages"][0]], tokenize=False, add_generation_prompt=True)
               for e in examples]
    common = dict(model=args.model, dtype="float32", max_model_len=256, seed=0, disable_log_stats=False)
    engines = {"plain": LLM(**common), "mars": LLM(**common, speculative_config={"method": "mars"})}  # (the last
    settings = [("plain", None)] + [("mars", None if tau < 0 else tau) for tau in args.thresholds]  # owns metrics)

    def params(tau):
        return SamplingParams(temperature=0.0, max_tokens=64, extra_args=None if tau is None else
                              {"mars_threshold": tau})

    def counters():
        got = {m.name: m.value for m in engines["mars"].get_metrics() if hasattr(m, "value")}
        return got.get("vllm:spec_decode_num_drafts", 0), got.get("vllm:spec_decode_num_accepted_tokens", 0)

    for name, tau in settings:  # warm-up
        engines[name].generate(prompts[:8], params(tau), use_tqdm=False)
    rows = {f"{name}" + ("" if tau is None else f" tau={tau:g}"): {"burst_s": [], "one_at_a_time_s": []}
            for name, tau in settings}
    for _ in range(args.interleaved):
        for (name, tau), row in zip(settings, rows.values()):
            before = counters()
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params(tau), use_tqdm=False)
            row["burst_s"].append(time.perf_counter() - t0)
            after = counters()
            t0 = time.perf_counter()
            for prompt in prompts[:args.one_at_a_time]:
                engines[name].generate([prompt], params(tau), use_tqdm=False)
            row["one_at_a_time_s"].append(time.perf_counter() - t0)
            texts = [o.outputs[0].text for o in outs]
            row["texts"] = texts
            row["completion_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            if name == "mars":
                drafts, accepted = after[0] - before[0], after[1] - before[1]
                row["tokens_per_forward"] = round(1 + accepted / drafts, 3) if drafts else None
    plain = rows["plain"]
    report = {"command": " ".join(["python"] + sys.argv), "model": args.model, "requests": len(prompts),
              "one_at_a_time_requests": args.one_at_a_time, "rounds": args.interleaved, "settings": {}}
    for label, row in rows.items():
        report["settings"][label] = {
            "tokens_per_forward": row.get("tokens_per_forward", 1.0),
            "burst_s": round(statistics.median(row["burst_s"]), 3),
            "one_at_a_time_s": round(statistics.median(row["one_at_a_time_s"]), 3),
            "burst_vs_plain": [round(p / m, 3) for p, m in zip(plain["burst_s"], row["burst_s"])],
            "one_at_a_time_vs_plain": [round(p / m, 3) for p, m in zip(plain["one_at_a_time_s"],
                                                                        row["one_at_a_time_s"])],
            "completion_tokens": row["completion_tokens"],
            "accuracy": data.accuracy([e["task"] for e in examples], row["texts"],
                                      [e["messages"][1]["content"] for e in examples])["overall"],
            "same_as_plain": sum(a == b for a, b in zip(row["texts"], plain["texts"]))}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["settings"], indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                   help="plain must come first (the Poisson rates and the equality column are relative to it)")
    p.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    p.add_argument("--logs", default="/tmp/vllm_mars_logs")
    p.add_argument("--interleaved", type=int, default=0, metavar="N",
                   help="time plain and MARS in one process, in turn, N rounds (offline engines; no servers)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[-1.0, 1.0, 0.9],
                   help="--interleaved: MARS at each request mars_threshold (-1: none, lossless)")
    p.add_argument("--one-at-a-time", type=int, default=48, help="--interleaved: questions sent one by one")
    args = p.parse_args()
    if args.interleaved:
        interleaved(args)
    elif args.settings[0] != "plain":
        p.error("--settings must start with plain")
    else:
        asyncio.run(main(args))
