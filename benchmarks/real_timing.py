"""Time a saved real-model MARS checkpoint the way `hf-mars demo --base` times the one it trains.

`benchmarks/real_recipe.py --save-dir` keeps checkpoints trained longer than the demo's 80 steps; this script
measures one of them with the demo's own decoding and timing code (`hf_mars.demo.real`), so the figures compare
with the demo's table: tokens per forward and agreement with greedy per mode on the held-out openings, then
seconds against plain `generate` in float32 at batch 1 and 4, and at batch 1 in bfloat16 and in float32 on
oneDNN's kernels (one interleaved pass per repeat), verify as the chain and the tree with and without the draft
vocabulary, and the step-cost curve split into body and LM head (MKL's and oneDNN's).

The draft vocabulary is the demo's: the most frequent tokens of the distilled answers the checkpoint was trained
on, rebuilt here from the base with the same ``--steps`` / ``--batch-size`` / ``--seed`` (distillation is greedy,
so these are the same answers).

    python benchmarks/real_timing.py --model runs/recipe160/full-5e-05 --steps 160 --output runs/real_timing_160.json

``--write-vocab`` also saves that vocabulary with the checkpoint as verify mode's default (``mars_draft_vocab`` in
its generation config, `hf_mars.hub.write_generation_defaults`), so `hf-mars bench` and `hf-mars serve` decode with it;
``--no-measure`` stops there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the MARS checkpoint folder (save_for_hub)")
    parser.add_argument("--base", default="gemma3-270m", help="the base it was trained from (for the draft vocabulary)")
    parser.add_argument("--steps", type=int, required=True, help="the MARS steps it was trained for")
    parser.add_argument("--batch-size", type=int, default=8, help="the batch it was trained with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-eval", type=int, default=12)
    parser.add_argument("--timing-prompts", type=int, default=6)
    parser.add_argument("--timing-repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="runs/real_timing.json")
    parser.add_argument("--write-vocab", action="store_true",
                        help="save the draft vocabulary with the checkpoint as verify mode's default")
    parser.add_argument("--no-measure", action="store_true", help="only build (and with --write-vocab, save) it")
    parser.add_argument("--saved-vocab", action="store_true",
                        help="use the vocabulary an earlier --write-vocab saved with the checkpoint (no distillation)")
    args = parser.parse_args(argv)

    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from hf_mars.bench.kernels import onednn_available
    from hf_mars.demo import real
    from hf_mars.demo.pipeline import _base_folder
    from hf_mars.generation import DEFAULT_VERIFY_THRESHOLD, enable_mars

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    args.dataset, args.verify_threshold = None, DEFAULT_VERIFY_THRESHOLD
    t0 = time.time()
    set_seed(args.seed)
    if args.saved_vocab:
        model, tokenizer = real._load(args.model)
        vocab = model.generation_config.mars_draft_vocab
        if not vocab:
            parser.error(f"--saved-vocab: {args.model} has no saved mars_draft_vocab (save one with --write-vocab)")
        prompts = real.held_out_prompts(args.num_eval)
    else:
        base_model, base_tokenizer = real._load(_base_folder(args.base))
        data = real._data(base_model, base_tokenizer, args)
        del base_model
        vocab, prompts = data["draft_vocab"], data["held_prompts"]
        print(f"draft vocabulary: {len(vocab)} tokens from {len(data['train'])} pairs in {time.time() - t0:.0f}s",
              flush=True)
        if args.no_measure:
            return _write_vocab(args, vocab)
        model, tokenizer = real._load(args.model)
    enable_mars(model)
    model.generation_config.mars_draft_vocab = None  # (one saved earlier would serve the rows measured without it)
    args.block_size = model.generation_config.mars_block_size
    report = {"model": args.model, "threads": torch.get_num_threads(), "draft_vocab": vocab,
              "decoding": real._decoding(model, tokenizer, prompts, args, vocab)}
    print(json.dumps(report["decoding"]), flush=True)
    report["step_costs"] = real.step_costs(model)
    if onednn_available():
        report["step_costs_onednn"] = real.step_costs(real.onednn_copy(model))
    report["timing"] = real._timing(model, tokenizer, prompts[:args.timing_prompts], args, vocab)
    report["timing_prompts"], report["timing_repeats"] = args.timing_prompts, args.timing_repeats
    for setting, seconds in report["timing"].items():
        plain = seconds["ar"]
        print(setting, {mode: f"{s:.1f}s ({plain / s:.2f}x)" for mode, s in seconds.items()}, flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return _write_vocab(args, vocab)


def _write_vocab(args, vocab) -> int:
    """``--write-vocab``: the vocabulary into the checkpoint's generation config (its card keeps what its save
    wrote)."""
    if args.write_vocab:
        from hf_mars.hub import write_generation_defaults

        config = json.loads((Path(args.model) / "config.json").read_text())
        write_generation_defaults(args.model, config["mars"], config_dict=config, draft_vocab=vocab)
        print(f"saved it as {args.model}'s verify default (generation_config.json mars_draft_vocab)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
