"""Verify on oneDNN's kernels is plain greedy on them: a saved real-model MARS checkpoint converted by
`hf_mars.demo.real.onednn_copy` (every linear layer on oneDNN, `hf_mars.bench.kernels`), each verify mode the demo
times (chain, tree, each with and without the checkpoint's saved draft vocabulary) against plain greedy decoding
of the same converted model, on the held-out openings the demo measures.

    python benchmarks/onednn_identity.py --model runs/recipe160/full-5e-05 --output runs/onednn_identity_160.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the MARS checkpoint folder, with a saved mars_draft_vocab")
    parser.add_argument("--num-eval", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="runs/onednn_identity.json")
    args = parser.parse_args(argv)

    import torch

    from hf_mars.demo import real
    from hf_mars.generation import DEFAULT_VERIFY_THRESHOLD, enable_mars

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = real._load(args.model)
    enable_mars(model)
    vocab = model.generation_config.mars_draft_vocab
    if not vocab:
        parser.error(f"{args.model} has no saved mars_draft_vocab (benchmarks/real_timing.py --write-vocab saves one)")
    model.generation_config.mars_draft_vocab = None  # (the rows without it must not draft from it)
    fast = real.onednn_copy(model)
    del model
    prompts = real.held_out_prompts(args.num_eval)
    args.block_size, args.verify_threshold = fast.generation_config.mars_block_size, DEFAULT_VERIFY_THRESHOLD
    greedy, _ = real._greedy_ids(fast, tokenizer, prompts, args.max_new_tokens)
    out = {}
    for name, kwargs in real._modes(args, vocab, ()).items():
        ids, tpf = real._greedy_ids(fast, tokenizer, prompts, args.max_new_tokens, **kwargs)
        out[name] = {"tokens_per_forward": round(tpf, 3), "identical_to_greedy": ids == greedy,
                     "agreement_with_greedy": real.agreement(ids, greedy)}
        print(name, out[name], flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"model": args.model, "prompts": len(prompts), "modes": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
