"""What the checkpoint sweeps share: load a MARS checkpoint and the demo's held-out split, score a set of
generate settings over it, and time them against plain `generate`, interleaved in one run."""

import argparse

from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars import enable_mars
from hf_mars.demo.bench import time_interleaved
from hf_mars.demo.data import generate_examples
from hf_mars.demo.pipeline import _encode_batches, _per_task_tpf, _prompts


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True)
    p.add_argument("--num-eval", type=int, default=320)
    p.add_argument("--timing-prompts", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    return p


def load(args):
    """(tokenizer, enable_mars'd model, the demo's held-out examples)."""
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    return tok, model, generate_examples(args.num_eval, seed=0, split="eval")


def score(model, tok, examples, settings: dict) -> dict:
    """Per setting: accuracy, tokens per forward and predictions over ``examples``."""
    out = {}
    with tqdm(total=len(settings) * len(examples), desc="scoring", unit="ex") as bar:
        for name, kw in settings.items():
            out[name] = _per_task_tpf(examples, model, tok, 64, bar, **kw)
    return out


def speedups(model, tok, examples, settings: dict, batch_size: int, repeats: int) -> dict:
    """Per setting: wall-clock speed-up over plain `generate` on ``examples`` at ``batch_size``."""
    batches = _encode_batches(tok, _prompts(tok, examples), batch_size)
    runs = {"plain": {}, **settings}
    with tqdm(total=len(runs) * repeats, desc=f"timing b={batch_size}", unit="run") as bar:
        seconds = time_interleaved(model, batches, runs, repeats, bar)
    return {name: seconds["plain"] / seconds[name] for name in settings}
