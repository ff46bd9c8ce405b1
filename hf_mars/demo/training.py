"""The two fine-tunes of `hf-mars demo`: MARS (`MARSTrainer`) and the compute-matched AR-SFT baseline (`SFTTrainer`).

Both start from the same base, with the same steps, batch, learning rate and examples (the MARS run cuts a share
of them, see `completion_rows`), in float32 on the CPU: what differs is the objective, and the cut examples that
show the masks the layout they meet when decoding.
"""

from __future__ import annotations

import time


def _train_config(cls, output_dir, args, **extra):
    from hf_mars.training.config import checkpointing_argument

    return cls(
        output_dir=str(output_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20),
        weight_decay=0.0,
        max_length=256,
        bf16=False,  # fp32: bf16 autocast is ~8x slower on CPU
        dataloader_pin_memory=False,  # CPU only: pinning does nothing (and torch warns so)
        **checkpointing_argument(cls, False),  # recomputing activations is pure overhead for a ~1M-parameter model
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
        **extra,
    )


def completion_rows(examples, tokenizer, cut_fraction=0.0, seed=0):
    """Chat examples as text prompt/completion rows; a share of them cut at a random point of the answer.

    Why the cut: decoding feeds masks right after *any* committed length ``c``, so inside the current
    block the masks follow real answer tokens. A full-answer MARS example never shows that layout
    (every answer token of a block is masked), and a small model then keys on the block position
    instead of counting masks: confidently wrong drafts in threshold mode. A cut example moves the
    first ``r`` answer characters into the prompt, so the noisy stream holds real tokens, then
    masks, at every offset inside a block — exactly the inference layout. The loss covers the
    completion only; ``cut_fraction=0`` gives the plain SFT rows (the AR baseline's data).
    """
    import random

    rng = random.Random(f"hf-mars-cut|{seed}")
    rows = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template([ex["messages"][0]], tokenize=False, add_generation_prompt=True)
        answer = ex["messages"][1]["content"]
        r = rng.randint(1, len(answer) - 1) if len(answer) > 1 and rng.random() < cut_fraction else 0
        rows.append({"prompt": prompt + answer[:r], "completion": answer[r:] + tokenizer.eos_token})
    return rows


def _load_base(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return model, tokenizer


def train_mars(base_path, train_examples, args, work_dir):
    from datasets import Dataset

    from hf_mars import MARSConfig, MARSTrainer

    model, tokenizer = _load_base(base_path)
    train_ds = Dataset.from_list(completion_rows(train_examples, tokenizer, args.cut_fraction, args.seed))
    config = _train_config(MARSConfig, work_dir / "mars-trainer", args, block_size=args.block_size, ar_weight=1.0)
    trainer = MARSTrainer(model=model, args=config, train_dataset=train_ds, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    return trainer.model.eval(), tokenizer, time.time() - t0


def train_ar_baseline(base_path, train_examples, args, work_dir):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _load_base(base_path)
    train_ds = Dataset.from_list(completion_rows(train_examples, tokenizer, 0.0, args.seed))
    config = _train_config(SFTConfig, work_dir / "ar-trainer", args)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, processing_class=tokenizer)
    t0 = time.time()
    trainer.train()
    return trainer.model.eval(), tokenizer, time.time() - t0

