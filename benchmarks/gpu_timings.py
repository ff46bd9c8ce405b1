"""Prepared GPU check: step costs and loop overhead on random Qwen2.5- and Gemma-3-shaped models in bf16.

No weights are needed (shapes are enough for timing). For Qwen2.5-0.5B and -7B shapes it measures,
at batch 1, 4 and 16 over a ~512-position cache:
- cost(w): one cached forward of w new positions (w = 1, 1+B, 2B, 16, 32, and the widths of verify mode's draft
  trees: `TREES`, 1 + nodes + (nodes + 1) x depth), LM head on the positions a loop reads; for each tree its
  cost(width)/cost(1), the factor its tokens per forward must beat (the "cost model" of `hf-mars bench`);
- plain greedy `generate`, its fast path (static cache + torch.compile) and prompt-lookup decoding (batch 1)
  against the MARS loop (tau = 0: every candidate accepted; sliding, block, verify, and verify with the static
  cache + torch.compile): wall time, forward calls, model time per step (synchronised hooks) and the loop's own
  overhead per step; speed-ups against plain `generate` and against the compiled plain path.

Forward hooks do not fire inside a compiled graph, so for the compiled modes the forward count and model time
per step are not meaningful (wall time and speed-ups are).

Run once, as one script, on a machine with a CUDA GPU (about 3-6 minutes on an H100/H200):

    python benchmarks/gpu_timings.py --output gpu_timings.json          # both shapes
    python benchmarks/gpu_timings.py --shapes 0.5b --batch-sizes 1 4    # quicker
    python benchmarks/gpu_timings.py --shapes tiny --device cpu          # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, intermediate, vocab, tie)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny-gemma3": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, intermediate_size=128, vocab_size=512, sliding_window=32,
                        tie_word_embeddings=True),
    # Gemma 3 270M (the real model hf-mars demo --base gemma3-270m fine-tunes): 5 sliding-window layers to 1 global,
    # a 262k-row LM head
    "gemma3-270m": dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=256, intermediate_size=2048, vocab_size=262144, sliding_window=512,
                        tie_word_embeddings=True),
}


TREES = ("1,1,1,1", "2,1,1,1", "2,2,1,1", "2,2,2,1", "3,2,2,1", "4,2,2,2")  # verify's draft trees (B = 4)


def tree_width(shape: str) -> int:
    """Positions one tree step forwards: the root, the nodes, and a group of depth masks after the root and each
    node (hf_mars.generation.tree)."""
    ks, nodes, level = [int(k) for k in shape.split(",")], 0, 1
    for k in ks:
        level *= k
        nodes += level
    return 1 + nodes + (nodes + 1) * len(ks)


def settle_auto(model, rows: int, call, kw, most: int = 12) -> str | None:
    """Verify's default ('auto') measures its layouts (the tree, the chain, plain steps) over a process's first
    calls for a model and batch size, then keeps the fastest (`hf_mars.generation.policy.CallRecord`); timing those
    first calls would time its warm-up, not what it settles on. Calls until the record settles (at most `most`);
    returns the layout kept (None for a mode that is not 'auto')."""
    from hf_mars.generation.policy import record_for

    if not kw.get("mars_verify") or kw.get("mars_draft_tree", "auto") != "auto" or "compile_config" in kw:
        return None
    for _ in range(most + 1):
        used = [record_for(model, rows, loop) for loop in ("call", "call-chain")]
        used = [record for record in used if record.calls]
        if used and all(record.warming() is None for record in used):
            return used[0].best()
        call()
    return "unsettled"


def build(shape: str, device: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    if "gemma3" in shape:
        cfg, model_class = Gemma3TextConfig(**SHAPES[shape], max_position_embeddings=32768), Gemma3ForCausalLM
    else:
        cfg, model_class = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6), Qwen2ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = model_class(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
    mask_id = cfg.vocab_size - 1
    cfg.mars = {"mask_token_id": mask_id, "mask_token": "<|mask|>", "block_size": 4}
    model.generation_config.eos_token_id = None  # random weights: run to length
    model.generation_config.pad_token_id = 0
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["0.5b", "7b"], choices=list(SHAPES))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--past", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default="gpu_timings.json")
    p.add_argument("--device", default="cuda", help="cuda (the real check) or cpu (a smoke run of the script)")
    p.add_argument("--compiled-batch-sizes", type=int, nargs="+", default=None,
                   help="batch sizes that also time the static cache + torch.compile modes (default: all); each new "
                        "batch size compiles again, the largest share of the script's time")
    p.add_argument("--modes", nargs="+", default=None,
                   help="only these modes (e.g. ar ar_static_compile verify_static_compile); plain 'ar' always runs")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds after which no further mode is started (recorded as skipped): a lease's time is "
                        "fixed, and what ran before must come back")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: this script is for a machine with a GPU (--device cpu for a smoke run).")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from transformers import CompileConfig

    from hf_mars._compat import compile_on_any_device
    from hf_mars.bench import ForwardRecorder, measure_step_costs
    from hf_mars.generation import enable_mars

    B = args.block_size
    trees = {t: tree_width(t) for t in TREES if len(t.split(",")) <= B}
    widths = sorted({1, 1 + B, 2 * B, 16, 32} | set(trees.values()))
    result = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "block_size": B,
              "past": args.past, "shapes": {}}
    for shape in args.shapes:
        model = build(shape, args.device)
        enable_mars(model)
        res = result["shapes"][shape] = {"params": sum(q.numel() for q in model.parameters()), "batches": {}}
        for b in args.batch_sizes:
            entry = res["batches"][str(b)] = {}
            costs = measure_step_costs(model, b, widths, args.past, repeats=20, block_size=B, statistic="median",
                                       device=torch.device(args.device))
            entry["cost_ms"] = {str(w): 1e3 * t for w, t in costs.items()}
            entry["tree_cost_vs_1"] = {t: costs[w] / costs[1] for t, w in trees.items()}
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(10, min(1000, model.config.vocab_size - 1), (b, args.prompt_len), generator=g).to(args.device)
            mask = torch.ones_like(ids)
            base = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens,
                        return_dict_in_generate=True)
            compiled = dict(cache_implementation="static", compile_config=compile_on_any_device(CompileConfig()))
            configs = {
                "ar": {},
                "ar_static_compile": dict(compiled),
                "prompt_lookup": dict(prompt_lookup_num_tokens=10),
                "sliding": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_cache="sliding"),
                "block16": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_cache="block", mars_cache_block=16),
                "verify": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_verify=True),
                "verify_chain": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_verify=True,
                                     mars_draft_tree="chain"),
                "verify_cost": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_verify=True,
                                    mars_draft_tree="cost"),
                "verify_static_compile": dict(mars=True, mars_threshold=0.0, mars_block_size=B, mars_verify=True,
                                              **compiled),
                # tau = 0 compiled: every guess accepted, compiled MARS's ceiling against compiled plain
                "sliding_static_compile": dict(mars=True, mars_threshold=0.0, mars_block_size=B, **compiled),
            }
            if b > 1:
                del configs["prompt_lookup"]  # transformers runs prompt lookup at batch 1 only
            if args.modes is not None:  # (plain eager generate is every speed-up's reference)
                configs = {name: kw for name, kw in configs.items() if name == "ar" or name in args.modes}
            if args.compiled_batch_sizes is not None and b not in args.compiled_batch_sizes:
                configs = {name: kw for name, kw in configs.items() if "compile_config" not in kw}
            for name, kw in configs.items():
                if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
                    entry[name] = {"skipped": f"deadline of {args.deadline_s:.0f} s"}
                    continue
                try:
                    for _ in range(2 if "compile_config" in kw else 1):  # warm-up (compiles)
                        model.generate(**base, **kw)
                    settled = settle_auto(model, b, lambda: model.generate(**base, **kw), kw)
                    walls = []
                    for _ in range(args.repeats):
                        sync()
                        t0 = time.perf_counter()
                        out = model.generate(**base, **kw)
                        sync()
                        walls.append(time.perf_counter() - t0)
                    with ForwardRecorder(model, sync=cuda) as rec:
                        model.generate(**base, **kw)
                    wall = statistics.median(walls)
                    new = out.sequences.shape[1] - ids.shape[1]
                    entry[name] = {
                        "wall_ms": wall * 1e3, "forwards": rec.calls, "new_tokens_per_row": new,
                        "tokens_per_s": b * new / wall,
                        "model_ms_per_step": rec.model_time / rec.calls * 1e3,
                        "overhead_ms_per_step": (wall - rec.model_time) / rec.calls * 1e3,
                        "mean_width": statistics.mean(rec.widths[1:]) if len(rec.widths) > 1 else None,
                    }
                    if settled is not None:
                        entry[name]["auto_layout"] = settled
                except Exception as exc:  # record and go on: one failing mode must not lose the others
                    entry[name] = {"error": f"{type(exc).__name__}: {exc}"}
            ar, fast = entry["ar"], entry.get("ar_static_compile", {})
            for name in configs:
                if "wall_ms" in entry[name] and "wall_ms" in ar:
                    entry[name]["speedup"] = entry[name]["tokens_per_s"] / ar["tokens_per_s"]
                    if "wall_ms" in fast:
                        entry[name]["speedup_vs_compiled_plain"] = entry[name]["tokens_per_s"] / fast["tokens_per_s"]
            print(json.dumps({shape: {b: entry}}, indent=None), flush=True)
            result["seconds"] = time.perf_counter() - started
            with open(args.output, "w") as f:  # after every batch: a run cut short keeps what it measured
                json.dump(result, f, indent=2)
        del model
        if cuda:
            torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output}")
    for shape, res in result["shapes"].items():
        print(f"\n{shape} ({res['params'] / 1e9:.2f}B params)")
        print("batch  cost(1)  cost(1+B)  ratio  | mode                   fwds  model ms/step  ovh ms/step  speedup"
              "  vs compiled plain")
        for b, e in res["batches"].items():
            c1, cB = e["cost_ms"]["1"], e["cost_ms"][str(1 + B)]
            for name in ("ar", "ar_static_compile", "prompt_lookup", "sliding", "block16", "verify", "verify_chain",
                         "verify_cost", "verify_static_compile", "sliding_static_compile"):
                if name not in e:
                    continue
                r = e[name]
                if "wall_ms" not in r:
                    print(f"{b:>5}  {name}: {r.get('error') or r.get('skipped')}")
                    continue
                label = f"{name} ({r['auto_layout']})" if r.get("auto_layout") else name  # what 'auto' kept
                print(f"{b:>5}  {c1:7.2f}  {cB:9.2f}  {cB / c1:5.2f}  | {label:22} {r['forwards']:4d}  "
                      f"{r['model_ms_per_step']:13.2f}  {r['overhead_ms_per_step']:11.2f}  {r.get('speedup', 1.0):6.2f}x"
                      f"  {r.get('speedup_vs_compiled_plain', float('nan')):6.2f}x")
            print("       draft trees, cost(width)/cost(1): " + ", ".join(
                f"{t} (w={tree_width(t)}) {v:.2f}" for t, v in e["tree_cost_vs_1"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
