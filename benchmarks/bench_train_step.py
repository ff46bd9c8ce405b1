"""Cost of one MARS training step against one plain SFT step on the same batch (CPU by default).

    OMP_NUM_THREADS=2 python benchmarks/bench_train_step.py                 # sdpa and eager
    python benchmarks/bench_train_step.py --attn sdpa --seq-len 512 --hidden-size 512 --layers 8

A step = forward + backward + AdamW update, on a batch collated by MARSTrainer's data collator (the SFT step
gets the very same tensors). The MARS step runs the model on [z ; x] (twice the length) with the 2n x 2n mask,
so ~2x is the floor; the target is <= 2.3x. flex_attention has no backward on CPU (torch 2.13): there it is
timed forward-only (and compiled on first use, which is excluded), marked as such.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import string
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", nargs="+", default=["sdpa", "eager", "flex_attention"])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="approximate tokens per example")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    return p.parse_args(argv)


def make_dataset(n, seq_len, seed=0):
    from datasets import Dataset

    rng = random.Random(seed)
    letters = string.ascii_lowercase + " "
    rows = []
    for _ in range(n):
        length = rng.randint(int(seq_len * 0.8), seq_len)
        prompt_len = length // 4
        text = "".join(rng.choice(letters) for _ in range(length))
        rows.append({"prompt": text[:prompt_len], "completion": text[prompt_len:]})
    return Dataset.from_list(rows)


def time_step(fn, repeats, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args, attn):
    import torch
    from trl import SFTConfig, SFTTrainer

    from hf_mars import MARSConfig, MARSTrainer, add_mask_token
    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    device = torch.device(args.device)
    tok = build_char_tokenizer()
    cfg = dict(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
               num_kv_heads=args.kv_heads, max_position=4 * args.seq_len + 64)
    mars_model = tiny_qwen2(tok, seed=0, attn_implementation=attn, **cfg)
    add_mask_token(mars_model, tok)
    sft_model = tiny_qwen2(tok, seed=0, attn_implementation=attn, **cfg)
    sft_model.resize_token_embeddings(mars_model.get_input_embeddings().weight.shape[0])
    data = make_dataset(args.batch_size, args.seq_len)
    out = tempfile.mkdtemp()
    common = dict(output_dir=out, report_to=[], per_device_train_batch_size=args.batch_size, max_length=None,
                  bf16=False, use_cpu=device.type == "cpu")
    on_cpu_flex = attn == "flex_attention" and device.type == "cpu"
    if on_cpu_flex:
        # MARSTrainer refuses flex on CPU (no backward); build it on sdpa, then switch the model to flex
        mars_model.config._attn_implementation = "sdpa"
    mars = MARSTrainer(mars_model, args=MARSConfig(block_size=args.block_size, **common), train_dataset=data,
                       processing_class=tok)
    sft = SFTTrainer(sft_model, args=SFTConfig(gradient_checkpointing=False, **common), train_dataset=data,
                     processing_class=tok)
    if on_cpu_flex:
        mars.model.config._attn_implementation = "flex_attention"
    batch = next(iter(mars.get_train_dataloader()))
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    ntok = int(batch["attention_mask"].sum())

    def step_fn(trainer, model, optimizer, backward):
        def step():
            if backward:
                loss = trainer.compute_loss(model, dict(batch))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    trainer.compute_loss(model, dict(batch))
        return step

    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    results = {}
    backward = not on_cpu_flex
    for name, trainer in (("mars", mars), ("sft", sft)):
        model = trainer.model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        results[name] = time_step(step_fn(trainer, model, opt, backward), args.repeats, args.warmup, sync)
    return results, ntok, batch["input_ids"].shape, backward


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}; model hidden "
          f"{args.hidden_size} x {args.layers} layers; batch {args.batch_size} x ~{args.seq_len} tokens; "
          f"B = {args.block_size}")
    print(f"{'attn':<15} {'step':<13} {'SFT s':>8} {'MARS s':>8} {'ratio':>6}")
    for attn in args.attn:
        try:
            res, ntok, shape, backward = bench(args, attn)
        except Exception as e:  # e.g. flex_attention failing to compile on this machine
            print(f"{attn:<15} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        kind = "fwd+bwd+adam" if backward else "forward only"
        print(f"{attn:<15} {kind:<13} {res['sft']:8.4f} {res['mars']:8.4f} {res['mars'] / res['sft']:6.2f}x"
              f"   (batch {tuple(shape)}, {ntok} real tokens)")


if __name__ == "__main__":
    main()
