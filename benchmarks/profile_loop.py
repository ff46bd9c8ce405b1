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
import pstats
import sys
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_FUNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
              "masked_select", "unique", "unique_consecutive", "argwhere", "repeat_interleave"}


class _State:
    in_forward = 0


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched outside the model's forward."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _State.in_forward:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter(TorchFunctionMode):
    """Counts calls that force a device->host sync (outside the model's forward), with their call sites."""

    def __init__(self, where_filter=("generation",)):
        super().__init__()
        self.syncs = collections.Counter()
        self.sites = collections.Counter()
        self.where_filter = where_filter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        sync = name in SYNC_FUNCS
        if name == "__getitem__" and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            sync = any(torch.is_tensor(i) and i.dtype == torch.bool for i in idx)
            name = "bool-index" if sync else name
        if sync and not _State.in_forward:
            self.syncs[name] += 1
            for fr in reversed(traceback.extract_stack(limit=8)[:-1]):
                if "profile_loop" not in fr.filename and "torch/" not in fr.filename:
                    self.sites[f"{name} @ {fr.filename.split('site-packages/')[-1]}:{fr.lineno} {fr.line}"] += 1
                    break
        return func(*args, **(kwargs or {}))


def _hooks(model, times):
    def pre(mod, args, kwargs):
        _State.in_forward += 1
        times.append(-time.perf_counter())

    def post(mod, args, kwargs, out):
        _State.in_forward -= 1
        times[-1] += time.perf_counter()

    return [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]


def build(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    else:
        from hf_mars import add_mask_token
        from hf_mars.tiny import build_char_tokenizer, tiny_qwen2

        tok = build_char_tokenizer()
        model = tiny_qwen2(tok, seed=0, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=max(2, args.hidden // 16), num_kv_heads=max(1, args.hidden // 32))
        add_mask_token(model, tok)
        model.generation_config.eos_token_id = None  # random weights: run to length
    from hf_mars.generation import enable_mars

    enable_mars(model)
    return model, tok


def run_one(model, inputs, kwargs, cprofile_n):
    times = []
    handles = _hooks(model, times)
    try:
        for _ in range(2):  # warm-up
            model.generate(**inputs, **kwargs)
        times.clear()
        t0 = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        wall = time.perf_counter() - t0
        calls, model_time = len(times), sum(times)
        ops, syncs = OpCounter(), SyncCounter()
        with ops, syncs:
            model.generate(**inputs, **kwargs)
        prof_text = ""
        if cprofile_n:
            pr = cProfile.Profile()
            pr.enable()
            model.generate(**inputs, **kwargs)
            pr.disable()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(r"^(?!.*(modeling_|torch/nn/|sdpa_attention|masking_utils|cache_utils|rope|integrations)).*$", cprofile_n)
            prof_text = s.getvalue()
    finally:
        for h in handles:
            h.remove()
    new = out.sequences.shape[1] - inputs["input_ids"].shape[1] if hasattr(out, "sequences") else out.shape[1] - inputs["input_ids"].shape[1]
    return {"wall": wall, "calls": calls, "model_time": model_time, "new_tokens": new,
            "ops": ops.ops, "syncs": syncs.syncs, "sites": syncs.sites, "profile": prof_text,
            "out": out}


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
    p.add_argument("--cprofile", type=int, default=0, help="print the top N functions (own time), model internals excluded")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = build(args)
    prompts = ["Copy: hello world", "What is 12+35?", "Reverse: abcdef", "Sort: dbca"] * 8
    enc = tok.apply_chat_template([[{"role": "user", "content": q}] for q in prompts[: args.batch_size]],
                                  add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True)
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    base = dict(do_sample=False, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    mars = dict(base, mars=True, mars_threshold=args.tau, mars_block_size=args.block_size, mars_cache=args.cache,
                mars_verify=args.verify)
    if args.cache == "block":
        mars["mars_cache_block"] = args.cache_block
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, torch threads {torch.get_num_threads()}")
    for label, kw in (("plain generate", base), (f"MARS {mars}", mars)):
        r = run_one(model, inputs, kw, args.cprofile)
        steps = max(r["calls"], 1)
        ovh = (r["wall"] - r["model_time"]) / steps * 1e3
        print(f"\n=== {label}")
        print(f"wall {r['wall'] * 1e3:.1f} ms, {r['calls']} forwards, {r['new_tokens']} new positions/row, "
              f"model {r['model_time'] / steps * 1e3:.3f} ms/step, loop overhead {ovh:.3f} ms/step "
              f"({(r['wall'] - r['model_time']) / r['wall']:.0%} of wall)")
        out = r["out"]
        if hasattr(out, "mars_forward_passes"):
            print(f"mars_forward_passes {out.mars_forward_passes.tolist()} mars_emitted_tokens {out.mars_emitted_tokens.tolist()}")
        n_ops = sum(r["ops"].values())
        print(f"torch ops outside forward: {n_ops / steps:.1f}/step; top: "
              + ", ".join(f"{k.replace('aten.', '')} {v / steps:.1f}" for k, v in r["ops"].most_common(12)))
        n_sync = sum(r["syncs"].values())
        print(f"host syncs outside forward: {n_sync / steps:.1f}/step: " + ", ".join(f"{k} {v / steps:.2f}" for k, v in r["syncs"].most_common()))
        for site, n in r["sites"].most_common(15):
            print(f"   {n / steps:5.2f}/step  {site}")
        if r["profile"]:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
