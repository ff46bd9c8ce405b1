"""Which fine-tune keeps a pretrained model's quality under MARS: full fine-tune vs LoRA, at equal steps.

The real-model demo (`hf-mars demo --base gemma3-270m`) full-fine-tuned Gemma 3 270M at lr 5e-5 and its held-out
perplexity on real text went from 30.9 to 88.6 (SFT on the same data: 130.5). This script trains MARS from the same
base on the same self-distilled pairs once per recipe ("arm") and measures, per arm:

- held-out perplexity on real text (held-out topics of Python's language reference, not the distilled answers);
- agreement of the MARS model's greedy (τ = 1) with the base's greedy on held-out openings;
- verify's tokens per forward (the fixed draft tree, or the chain where the cache allows no tree) on the same openings, and that verify equals its own greedy;
- threshold mode's tokens per forward at each ``--thresholds`` τ, with the share of its tokens equal to the model's own greedy;
- the training's seconds per step.

Arms are ``KIND:LR`` with KIND ``full`` or ``loraR`` (LoRA of rank R on every linear layer, merged afterwards).

    python benchmarks/real_recipe.py --base gemma3-270m --steps 24 --threads 1 \
        --arms full:5e-5 lora16:2e-4 full:1e-5 --output runs/real_recipe.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def parse_arm(text: str) -> tuple[int, float]:
    kind, _, lr = text.partition(":")
    if not lr or not (kind == "full" or (kind.startswith("lora") and kind[4:].isdigit())):
        raise argparse.ArgumentTypeError(f"an arm is full:LR or loraR:LR, got {text!r}")
    return (0 if kind == "full" else int(kind[4:])), float(lr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="gemma3-270m")
    parser.add_argument("--arms", nargs="+", type=parse_arm, default=[parse_arm("full:5e-5"), parse_arm("lora16:2e-4")])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-eval", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--thresholds", nargs="*", type=float, default=[0.95, 0.9],
                        help="threshold mode's tau values to measure per arm (none: verify only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/real_recipe.json")
    parser.add_argument("--save-dir", default=None,
                        help="also save each arm's checkpoint (save_for_hub) under this folder, for hf-mars bench")
    args = parser.parse_args(argv)

    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from hf_mars.demo import real
    from hf_mars.demo.pipeline import _base_folder
    from hf_mars.generation import DEFAULT_VERIFY_THRESHOLD, enable_mars

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    base = _base_folder(args.base)
    args.cut_fraction, args.train_embeddings, args.quick = 0.5, False, False
    set_seed(args.seed)
    base_model, tokenizer = real._load(base)
    t0 = time.time()
    data = real._data(base_model, tokenizer, args)
    print(f"data: {len(data['train'])} pairs in {time.time() - t0:.0f}s", flush=True)
    texts, prompts = data["held_text"], data["held_prompts"]
    base_ids, _ = real._greedy_ids(base_model, tokenizer, prompts, args.max_new_tokens)
    report = {"base": str(base), "steps": args.steps, "batch_size": args.batch_size, "pairs": len(data["train"]),
              "threads": torch.get_num_threads(), "perplexity_base": real.perplexity(base_model, tokenizer, texts),
              "arms": []}
    verify = {"mars": True, "mars_verify": True, "mars_threshold": DEFAULT_VERIFY_THRESHOLD,
              "mars_draft_tree": "tree" if real._tree_for(base_model, tokenizer, prompts, args) else "chain"}
    work = Path(tempfile.mkdtemp(prefix="real_recipe-"))
    for rank, lr in args.arms:
        args.lora_rank, args.learning_rate = rank, lr
        set_seed(args.seed)
        model, seconds = real._train(base, tokenizer, data["train"], args, work, mars=True)
        enable_mars(model)
        greedy, _ = real._greedy_ids(model, tokenizer, prompts, args.max_new_tokens)
        drafted, tpf = real._greedy_ids(model, tokenizer, prompts, args.max_new_tokens, **verify)
        arm = {"arm": f"{'full' if not rank else f'lora{rank}'}:{lr:g}", "lora_rank": rank, "learning_rate": lr,
               "train_seconds": round(seconds, 1), "seconds_per_step": round(seconds / args.steps, 2),
               "perplexity": real.perplexity(model, tokenizer, texts),
               "greedy_agreement_with_base": real.agreement(greedy, base_ids),
               "verify_tokens_per_forward": tpf, "verify_identical_to_greedy": drafted == greedy, "threshold": {}}
        for tau in args.thresholds:
            ids, tau_tpf = real._greedy_ids(model, tokenizer, prompts, args.max_new_tokens, mars=True,
                                            mars_threshold=tau)  # (masks on every step: `real._greedy_ids`)
            arm["threshold"][str(tau)] = {"tokens_per_forward": tau_tpf,
                                          "agreement_with_greedy": real.agreement(ids, greedy)}
        if args.save_dir:
            from hf_mars.hub import save_for_hub

            model.generation_config.do_sample = False
            save_for_hub(model, tokenizer, Path(args.save_dir) / arm["arm"].replace(":", "-"),
                         mars_block_size=args.block_size, mars_threshold=1.0, model_name=f"{Path(base).name}-mars",
                         description=f"{Path(base).name} MARS-fine-tuned by benchmarks/real_recipe.py ({arm['arm']}, "
                                     f"{args.steps} steps)", example_prompt=prompts[0])
        report["arms"].append(arm)
        print(json.dumps(arm), flush=True)
        del model
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
