"""MARS fine-tuning with TRL's command line: `MARSConfig` + `ScriptArguments` + `ModelConfig`, like TRL's sft.py.

Offline smoke run on a tiny, locally built model and synthetic chat data (< 1 minute on CPU):

    python examples/train_mars.py --config examples/configs/train_mars_tiny.yaml

Any MARSConfig / SFTConfig / TrainingArguments field can be set in the YAML or overridden on the command line
(`--block_size 8 --ar_weight 0.5 --loss_normalization token`). Multi-process / multi-GPU:

    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_mars.py --config ...
    accelerate launch --config_file examples/accelerate/deepspeed_zero2.yaml examples/train_mars.py --config ...
    accelerate launch --config_file examples/accelerate/fsdp.yaml examples/train_mars.py --config ...

A real run: start from an AR-SFT checkpoint (the paper does), e.g.

    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_mars.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/Capybara \
        --assistant_only_loss --block_size 4 --learning_rate 5e-6 --num_train_epochs 5 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 8 --max_length 512 \
        --warmup_ratio 0.03 --bf16 --output_dir runs/qwen2.5-0.5b-mars

`dataset_name` is anything `datasets.load_dataset` takes (a Hub id, or a local folder of json/jsonl/parquet
files); in every TRL format (conversational `messages`, `prompt`/`completion`, plain `text`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class MARSScriptArguments:
    """Extras of this example (for offline runs); everything else is TRL's ScriptArguments."""

    tiny_model: bool = field(
        default=False,
        metadata={"help": "If model_name_or_path does not exist, build a tiny random Qwen2 with the character-level "
                          "tokenizer of hf_mars.testing_utils there first (offline smoke runs)."},
    )
    tiny_dataset_size: int = field(
        default=0,
        metadata={"help": "If > 0 and no dataset_name is given, train on this many synthetic chat examples "
                          "(word swapping / copying / addition), with a held-out split for evaluation."},
    )


def synthetic_chat_dataset(n: int, seed: int = 0):
    """Small conversational tasks whose answers are partly predictable several tokens ahead."""
    from datasets import Dataset, DatasetDict

    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rock"]

    def one(rng):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.sample(words, 2)
            return f"swap {a} {b}", f"{b} {a}"
        if kind == 1:
            seq = " ".join(rng.choice(words) for _ in range(rng.randint(2, 4)))
            return f"copy {seq}", seq
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"add {a} {b}", f"{a} + {b} = {a + b}"

    def rows(count, rng):
        out = []
        for _ in range(count):
            question, answer = one(rng)
            out.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]})
        return out

    rng = random.Random(seed)
    return DatasetDict({"train": Dataset.from_list(rows(n, rng)),
                        "test": Dataset.from_list(rows(max(8, n // 10), rng))})


def build_tiny_model(path: str, seed: int = 0) -> None:
    from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

    tokenizer = build_char_tokenizer()
    model = tiny_qwen2(tokenizer, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main(script_args, training_args, model_args, extra_args):
    from accelerate import PartialState
    from datasets import load_dataset
    from trl import get_peft_config, get_quantization_config

    from hf_mars import MARSTrainer

    if extra_args.tiny_model and not os.path.isdir(model_args.model_name_or_path):
        with PartialState().main_process_first():  # one process builds it, the others then load it
            if not os.path.isdir(model_args.model_name_or_path):
                build_tiny_model(model_args.model_name_or_path, seed=training_args.seed)

    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation or "sdpa", dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    if script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    elif extra_args.tiny_dataset_size > 0:
        dataset = synthetic_chat_dataset(extra_args.tiny_dataset_size, seed=training_args.seed)
    else:
        raise ValueError("Set dataset_name (a Hub id or a local data folder), or tiny_dataset_size for synthetic data.")

    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = MARSTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.accelerator.print(
        f"MARS training: world_size={trainer.accelerator.num_processes}, "
        f"distributed={trainer.accelerator.distributed_type.value}, block_size={training_args.block_size}, "
        f"ar_weight={training_args.ar_weight}, loss_normalization={training_args.loss_normalization}, "
        f"mask_token_id={trainer.mask_token_id}"
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.accelerator.print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Saved the MARS model to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # accelerate's documented last call: it tears the process group down before the interpreter exits (left to
    # exit-time teardown, a rank of a two-process CPU run aborted once in CI: "terminate called without an active
    # exception", after the model was saved)
    trainer.accelerator.end_training()


def make_parser():
    from trl import ModelConfig, ScriptArguments, TrlParser

    from hf_mars import MARSConfig

    return TrlParser((ScriptArguments, MARSConfig, ModelConfig, MARSScriptArguments))


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, extra_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args, extra_args)
