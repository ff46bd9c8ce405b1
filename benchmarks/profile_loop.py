"""Where does a decoding step's time go outside the model? MARS loop vs plain `generate` (`_sample`).

For one configuration this prints, for plain greedy `generate` and for the MARS loop:
- wall time, forward calls, model time (forward hooks), loop overhead per step;
- torch ops dispatched outside the model's forward per step (on a GPU: ~one kernel launch each);
- host-device synchronisation points per step (.item(), .tolist(), bool(tensor), nonzero, boolean
  indexing ... — free on CPU, a pipeline stall each on a GPU), with the call sites;
- optionally (--cprofile N) the top N functions by own time, model internals excluded.

Random weights with tau = 0 give multi-token steps (every mask candidate accepted);
EOS is disabled on random models so both loops run the full length.

    python benchmarks/profile_loop.py --hidden 64 --layers 2 --batch-size 1 --tau 0 --cprofile 25
    python benchmarks/profile_loop.py --model path/to/ckpt --tau 0.9 --batch-size 4
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ops that make the host wait for the device (free on CPU, a pipeline stall each on a GPU)
SYNC_ATEN = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "unique_", "unique_consecutive",
             "repeat_interleave.Tensor", "equal.")
SYNC_PY = {"tolist", "numpy", "cpu"}  # device->host copies that do not show up as an aten op


class _State:
    in_forward = 0


def _site(skip=("profile_loop", "torch/", "contextlib")):
    for fr in reversed(traceback.extract_stack(limit=12)[:-2]):
        if not any(s in fr.filename for s in skip):
            return f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno} {fr.line}"
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched outside the model's forward, and the ones among them that sync."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.op_lines = collections.Counter()
        self.syncs = collections.Counter()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _State.in_forward:
            name = str(func)
            self.ops[name] += 1
            self.op_lines[_site()] += 1
            is_sync = any(s in name for s in SYNC_ATEN)
            if name.startswith("aten.index.Tensor"):  # boolean-mask indexing sizes its output from the data
                idx = args[1] if len(args) > 1 else []
                is_sync = any(torch.is_tensor(i) and i.dtype == torch.bool for i in idx if i is not None)
            if is_sync:
                self.syncs[name.replace("aten.", "")] += 1
                self.sites[f"{name.replace('aten.', '')} @ {_site()}"] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter(TorchFunctionMode):
    """Counts .tolist() / .cpu() / .numpy() outside the model's forward (device->host copies), with call sites."""

    def __init__(self):
        super().__init__()
        self.syncs = collections.Counter()
        self.sites = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not _State.in_forward:
            if name in SYNC_PY:
                self.syncs[name] += 1
                self.sites[f"{name} @ {_site()}"] += 1
            elif name in ("tensor", "as_tensor") and args and not torch.is_tensor(args[0]):
                # a tensor built from Python data: on CUDA an H2D copy that (non_blocking=False, pageable
                # memory) ends in cudaStreamSynchronize, i.e. a full sync like .item()
                self.syncs["torch.tensor(host data)"] += 1
                self.sites[f"torch.{name}(host data) @ {_site()}"] += 1
        return func(*args, **(kwargs or {}))


def _hooks(model, spans):
    """Record (start, end) of every top-level forward: gaps between them are the loop's per-step work."""

    def pre(mod, args, kwargs):
        _State.in_forward += 1
        spans.append([time.perf_counter(), None])

    def post(mod, args, kwargs, out):
        _State.in_forward -= 1
        spans[-1][1] = time.perf_counter()

    return [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]


def build(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    else:
        from hf_mars import add_mask_token
        from hf_mars.demo.tiny import build_char_tokenizer, tiny_qwen2

        tok = build_char_tokenizer()
        model = tiny_qwen2(tok, seed=0, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=max(2, args.hidden // 16), num_kv_heads=max(1, args.hidden // 32))
        add_mask_token(model, tok)
        model.generation_config.eos_token_id = None  # random weights: run to length
    from hf_mars.generation import enable_mars

    enable_mars(model)
    return model, tok


def run_all(model, batches, configs, cprofile_n, repeats=5):
    """Time `generate` for every configuration over the prompt batches, interleaved (each batch, each repeat:
    every configuration in turn, so drift on a shared machine hits all alike); the median run of each batch
    counts, with every step's gap. Then count ops and syncs over one more pass of every batch."""
    spans = []
    handles = _hooks(model, spans)
    results = []
    try:
        for kwargs in configs:
            for _ in range(2):  # warm-up
                model.generate(**batches[0], **kwargs)
        acc = [dict(wall=0.0, model_time=0.0, setup=0.0, teardown=0.0, calls=0, gaps=[]) for _ in configs]
        for inputs in batches:
            runs = [[] for _ in configs]
            for _ in range(repeats):
                for c, kwargs in enumerate(configs):
                    spans.clear()
                    t0 = time.perf_counter()
                    out = model.generate(**inputs, **kwargs)
                    t1 = time.perf_counter()
                    runs[c].append((t1 - t0, spans[0][0] - t0, t1 - spans[-1][1], sum(e - s for s, e in spans),
                                    len(spans), [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]))
            for c in range(len(configs)):
                w, su, td, mt, n, gaps = sorted(runs[c], key=lambda x: x[0])[repeats // 2]
                a = acc[c]
                a["wall"] += w
                a["setup"] += su
                a["teardown"] += td
                a["model_time"] += mt
                a["calls"] += n
                a["gaps"] += gaps
        for c, kwargs in enumerate(configs):
            ops, syncs = OpCounter(), SyncCounter()
            with ops, syncs:
                for inputs in batches:
                    out = model.generate(**inputs, **kwargs)
            prof_text = ""
            if cprofile_n:
                pr = cProfile.Profile()
                pr.enable()
                for inputs in batches:
                    model.generate(**inputs, **kwargs)
                pr.disable()
                s = io.StringIO()
                st = pstats.Stats(pr, stream=s)
                st.sort_stats("tottime").print_stats(r"^(?!.*(modeling_|torch/nn/|sdpa_attention|masking_utils|cache_utils|rope|integrations)).*$", cprofile_n)
                prof_text = s.getvalue()
            a, nb = acc[c], len(batches)
            new = (out.sequences if hasattr(out, "sequences") else out).shape[1] - inputs["input_ids"].shape[1]
            results.append({"wall": a["wall"], "calls": a["calls"], "model_time": a["model_time"], "new_tokens": new,
                            "setup": a["setup"] / nb, "teardown": a["teardown"] / nb,
                            "gap": statistics.median(a["gaps"]) if a["gaps"] else 0.0,
                            "gap_mean": statistics.mean(a["gaps"]) if a["gaps"] else 0.0, "batches": nb,
                            "ops": ops.ops, "op_lines": ops.op_lines, "syncs": ops.syncs + syncs.syncs,
                            "sites": ops.sites + syncs.sites, "profile": prof_text, "out": out})
    finally:
        for h in handles:
            h.remove()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: a random tiny Qwen2)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tau", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--cache", default="sliding", choices=["sliding", "block"])
    p.add_argument("--cache-block", type=int, default=16)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--generate-kwargs", default="{}", help='extra generate arguments as JSON, e.g. \'{"repetition_penalty": 1.1}\'')
    p.add_argument("--op-lines", type=int, default=0, help="print the N source lines that dispatch the most ops")
    p.add_argument("--cprofile", type=int, default=0, help="print the top N functions (own time), model internals excluded")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="decode the first N of the demo's held-out prompts (hf_mars.demo.bench.load_prompts) in "
                        "batches of --batch-size; figures are over every step of every batch (default: one batch "
                        "of four toy prompts)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch (the median one counts)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = build(args)
    if args.num_prompts:
        from hf_mars.demo.bench import load_prompts

        convs = [r["prompt"] for r in load_prompts(limit=args.num_prompts)]
    else:
        convs = [[{"role": "user", "content": q}]
                 for q in ["Copy: hello world", "What is 12+35?", "Reverse: abcdef", "Sort: dbca"] * 8][: args.batch_size]
    tok.padding_side = "left"
    batches = []
    for i in range(0, len(convs), args.batch_size):
        enc = tok.apply_chat_template(convs[i:i + args.batch_size], add_generation_prompt=True, padding=True,
                                      return_tensors="pt", return_dict=True)
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    base = dict(do_sample=False, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                **json.loads(args.generate_kwargs))
    mars = dict(base, mars=True, mars_threshold=args.tau, mars_block_size=args.block_size, mars_cache=args.cache,
                mars_verify=args.verify)
    if args.cache == "block":
        mars["mars_cache_block"] = args.cache_block
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, torch threads {torch.get_num_threads()}")
    results = run_all(model, batches, [base, mars], args.cprofile, args.repeats)
    for label, r in zip(("plain generate", f"MARS {mars}"), results):
        steps = max(r["calls"], 1)
        ovh = (r["wall"] - r["model_time"]) / steps * 1e3
        print(f"\n=== {label}")
        print(f"{r['batches']} batch(es): wall {r['wall'] * 1e3:.1f} ms, {r['calls']} forwards, last batch {r['new_tokens']} new positions/row, "
              f"model {r['model_time'] / steps * 1e3:.3f} ms/step, loop overhead {ovh:.3f} ms/step "
              f"({(r['wall'] - r['model_time']) / r['wall']:.0%} of wall)")
        print(f"  = setup before the first forward {r['setup'] * 1e3:.2f} ms + between forwards {r['gap'] * 1e3:.3f} ms/step "
              f"(median; mean {r['gap_mean'] * 1e3:.3f}) + after the last {r['teardown'] * 1e3:.2f} ms")
        out = r["out"]
        if hasattr(out, "mars_forward_passes"):
            print(f"mars_forward_passes {out.mars_forward_passes.tolist()} mars_emitted_tokens {out.mars_emitted_tokens.tolist()}")
        n_ops = sum(r["ops"].values())
        print(f"torch ops outside forward: {n_ops / steps:.1f}/step; top: "
              + ", ".join(f"{k.replace('aten.', '')} {v / steps:.1f}" for k, v in r["ops"].most_common(12)))
        n_sync = sum(r["syncs"].values())
        print(f"host syncs outside forward (on CUDA; torch.tensor(host data) counts as one): {n_sync / steps:.1f}/step: " + ", ".join(f"{k} {v / steps:.2f}" for k, v in r["syncs"].most_common()))
        for site, n in r["sites"].most_common(15):
            print(f"   {n / steps:5.2f}/step  {site}")
        if args.op_lines:
            print("source lines dispatching the most torch ops outside the forward (per step):")
            for site, n in r["op_lines"].most_common(args.op_lines):
                print(f"   {n / steps:5.2f}/step  {site}")
        if r["profile"]:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
