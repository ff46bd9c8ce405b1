"""Cost of one MARS training step against one plain SFT step on the same batch (CPU by default).

    OMP_NUM_THREADS=2 python benchmarks/bench_train_step.py                 # sdpa and eager
    python benchmarks/bench_train_step.py --attn sdpa --seq-len 512 --hidden-size 512 --layers 8
    python benchmarks/bench_train_step.py --model ~/.cache/hf-mars/gemma3-270m --attn sdpa --seq-len 200 \
        --freeze-embeddings --head-at-every-position --repeats 3 --warmup 1    # a real checkpoint folder

A step = forward + backward + AdamW update, on a batch collated by MARSTrainer's data collator (the SFT step
gets the very same tensors). The MARS step runs the model on [z ; x] (twice the length) with the 2n x 2n mask,
so ~2x is the floor; the target is <= 2.3x. flex_attention has no backward on CPU (torch 2.13): there it is
timed forward-only (and compiled on first use, which is excluded), marked as such.

``--model``: a checkpoint folder (fp32) instead of the random tiny model, e.g. Gemma 3 270M as `hf-mars demo
--base gemma3-270m` converts it. ``--head-at-every-position`` also times the MARS step with TRL's fused LM head
over every position of both streams, as TRL does on a CPU by itself (MARSTrainer has it score only the positions
with a target: ``hf_mars._compat.fused_head_on_targets_only``).
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
    p.add_argument("--model", default=None, help="a checkpoint folder to time instead of the random tiny model")
    p.add_argument("--freeze-embeddings", action="store_true", help="no gradient for the input embeddings "
                   "(hf-mars demo's real-model default: a tied 262k-row table dominates AdamW there)")
    p.add_argument("--head-at-every-position", action="store_true",
                   help="also time MARS with the LM head over every position (TRL's own choice on a CPU)")
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


def models(args, attn):
    """(tokenizer, MARS model with the mask token, SFT model of the same shape): ``--model``'s or tiny random."""
    from hf_mars import add_mask_token
    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        mars_model, sft_model = (AutoModelForCausalLM.from_pretrained(args.model, dtype="float32",
                                                                      attn_implementation=attn) for _ in range(2))
    else:
        tok = build_char_tokenizer()
        cfg = dict(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                   num_kv_heads=args.kv_heads, max_position=4 * args.seq_len + 64)
        mars_model, sft_model = (tiny_qwen2(tok, seed=0, attn_implementation=attn, **cfg) for _ in range(2))
    add_mask_token(mars_model, tok)
    sft_model.resize_token_embeddings(mars_model.get_input_embeddings().weight.shape[0])
    for model in (mars_model, sft_model) if args.freeze_embeddings else ():
        model.get_input_embeddings().weight.requires_grad_(False)
    return tok, mars_model, sft_model


def bench(args, attn):
    import contextlib
    from unittest import mock

    import torch
    from trl import SFTConfig, SFTTrainer

    import hf_mars.training.trainer as trainer_module
    from hf_mars import MARSConfig, MARSTrainer

    device = torch.device(args.device)
    tok, mars_model, sft_model = models(args, attn)
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
    runs = [("mars", mars), ("sft", sft)] + ([("mars_every_position", mars)] if args.head_at_every_position else [])
    for name, trainer in runs:
        model = trainer.model.to(device).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        # the every-position run: MARSTrainer's forward without the switch to TRL's compact head
        head = mock.patch.object(trainer_module, "fused_head_on_targets_only", contextlib.nullcontext) \
            if name == "mars_every_position" else contextlib.nullcontext()
        with head:
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
        if "mars_every_position" in res:
            every = res["mars_every_position"]
            print(f"{'':<15} {'head at every position':<28} {every:8.4f} {every / res['sft']:6.2f}x "
                  f"(the MARS step {every / res['mars']:.2f}x slower)")


if __name__ == "__main__":
    main()
