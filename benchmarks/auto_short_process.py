"""Verify's default 'auto' in a short process: a fresh process, one plain warm-up call, then a few passes over
48 held-out demo prompts at one batch size, timed per pass, against a fixed layout in its own fresh process.
'auto' measures layouts per call (`hf_mars.generation.policy.CallRecord`); in a process this short its warm-up is
most of its life, which is what this times.

    for layout in auto chain tree; do
        taskset -c 0 python benchmarks/auto_short_process.py $layout 16 3 --model runs/demo/mars-checkpoint
    done
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mars.bench.prompts import encode_prompts, load_prompts, make_batches
from hf_mars.generation import enable_mars
from hf_mars.generation.policy import choices_for


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layout", help="mars_draft_tree: auto, chain, tree, ...")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("passes", type=int)
    parser.add_argument("--model", default="runs/demo/mars-checkpoint")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = enable_mars(AutoModelForCausalLM.from_pretrained(args.model).eval())
    enc = encode_prompts(tok, [r["prompt"] for r in load_prompts(None, 48)])
    batches = make_batches(enc, args.batch_size, tok.pad_token_id, 48)
    kw = dict(mars=True, mars_verify=True, mars_threshold=0.3, mars_cache="sliding", max_new_tokens=64,
              do_sample=False, mars_draft_tree=args.layout)
    with torch.inference_mode():  # a user's first call pays the process's start-up; not what is timed here
        model.generate(input_ids=batches[0][0], attention_mask=batches[0][1], max_new_tokens=8, do_sample=False)
    times = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids, mask in batches:
                model.generate(input_ids=ids, attention_mask=mask, **kw)
        times.append(round(time.perf_counter() - t0, 3))
    print(args.layout, args.batch_size, "seconds per pass:", times, "total:", round(sum(times), 3),
          "layouts chosen (calls):", dict(choices_for(model, args.batch_size, "call")))


if __name__ == "__main__":
    main()
