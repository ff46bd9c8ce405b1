"""Rebuild the small MARS model the CPU figures in benchmarks/README.md were measured on.

A 0.61M-parameter Qwen2 (hidden 128, 4 layers, char-level tokenizer of hf_mars.testing_utils) trained from
scratch with `MARSTrainer` (B = 4, ar_weight 1) on hf_mars.bench.tasks, in two phases exactly as measured:
400 steps (lr 3e-3, data seed 0) then 700 more (lr 2e-3, data seed 1), batch 32, fp32, one thread.
About 20 minutes on 2 CPU cores. It is a timing subject, not a good model (whole-answer accuracy ~3%).

    python benchmarks/train_bench_model.py --output-dir /tmp/bench-model
    hf-mars bench --model /tmp/bench-model --thresholds 1.0 0.95 0.9 --caches sliding --verify-thresholds 0.0
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _phase(model, tokenizer, out, steps, lr, seed, n_examples, warmup):
    from hf_mars import MARSConfig, MARSTrainer
    from hf_mars.bench.tasks import make_dataset

    train = make_dataset(n_examples, seed=seed, split="train")
    cfg = MARSConfig(output_dir=os.path.join(out, "_trainer"), max_steps=steps, per_device_train_batch_size=32,
                     learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=warmup,
                     weight_decay=0.0, max_length=256, assistant_only_loss=True, bf16=False,
                     gradient_checkpointing=False, use_cpu=True, seed=seed, logging_steps=50, save_strategy="no",
                     report_to="none", dataloader_num_workers=0, block_size=4)
    trainer = MARSTrainer(model=model, args=cfg, train_dataset=train, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    print(f"phase: {steps} steps in {time.time() - t0:.0f} s", flush=True)
    return trainer.model.eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, nargs=2, default=[400, 700], help="steps of the two phases")
    args = p.parse_args(argv)
    import shutil

    import torch

    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=0, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                       intermediate_size=256, max_position=256)
    model = _phase(model, tok, args.output_dir, args.steps[0], 3e-3, 0, 30000, max(1, args.steps[0] // 30))
    model = _phase(model, tok, args.output_dir, args.steps[1], 2e-3, 1, 40000, 10)
    model.save_pretrained(args.output_dir)
    tok.save_pretrained(args.output_dir)
    shutil.rmtree(os.path.join(args.output_dir, "_trainer"), ignore_errors=True)
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
