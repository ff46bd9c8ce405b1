"""Rebuild the tiny AR-SFT base model shipped in hf_mars/demo/assets/tiny-base (the start of `hf-mars demo`).

A small Qwen2 is trained from scratch by plain TRL `SFTTrainer` on the bundled
instruction data (hf_mars.bench.tasks), on CPU, in fp32. This is the paper's first
stage ("AR SFT"); MARS fine-tuning then starts from this checkpoint.

    python examples/build_tiny_base.py                       # writes hf_mars/demo/assets/tiny-base
    python examples/build_tiny_base.py --output-dir /tmp/base --max-steps 300   # a quick look

Deterministic for a given seed and thread count (CPU training; float reductions
may differ across machines in the last bits). The shipped one was built with
`--threads 1` in 29 minutes on a shared 2-core machine (97.2% exact match on the held-out split).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hf_mars" / "demo" / "assets" / "tiny-base"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=str(DEFAULT_OUT))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--num-train", type=int, default=60000, help="training examples drawn (the run cycles over them)")
    p.add_argument("--num-eval", type=int, default=320)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from hf_mars.bench.tasks import make_dataset
    from hf_mars.demo.pipeline import evaluate_ar
    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = tiny_qwen2(tokenizer, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                       intermediate_size=args.intermediate_size, max_position=256)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    train = make_dataset(args.num_train, seed=args.seed, split="train")
    out = Path(args.output_dir)
    config = SFTConfig(
        output_dir=str(out / "_trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 30),
        weight_decay=0.0,
        max_length=256,
        assistant_only_loss=True,  # the chat template's {% generation %} markers: loss on the answer only
        bf16=False,  # fp32 on CPU: TRL's bf16 default is ~8x slower here
        gradient_checkpointing=False,  # TRL defaults to True; pure overhead for a 1M-parameter model
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    model = trainer.model.eval()
    eval_ds = make_dataset(args.num_eval, seed=args.seed, split="eval")
    result = evaluate_ar(model, tokenizer, eval_ds)
    print(json.dumps({"accuracy": result["accuracy"], "per_task": result["per_task"], "train_s": round(train_s, 1)}))

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {"seed": args.seed, "max_steps": args.max_steps, "batch_size": args.batch_size,
            "learning_rate": args.learning_rate, "parameters": n_params, "train_seconds": round(train_s, 1),
            "eval_accuracy": result["accuracy"], "eval_per_task": result["per_task"],
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "built_by": "python examples/build_tiny_base.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    import shutil

    shutil.rmtree(out / "_trainer", ignore_errors=True)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
