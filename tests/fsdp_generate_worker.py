"""Run by tests/test_distributed.py under torch.distributed.run: MARS generation with FSDP2-sharded parameters.

Each rank decodes its own prompts with a different token budget, so one rank finishes much earlier and must keep
forwarding (synced lockstep) until the other is done. Writes each rank's sequences for the test to compare.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_mars import add_mask_token, enable_mars
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2
from hf_mars.training.tokens import set_mars_metadata


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=1, initializer_range=0.5)
    add_mask_token(model, tok)
    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    enable_mars(model)
    reference = copy.deepcopy(model)  # the same weights, unsharded, in this process
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prompts = ["hello world"] if rank == 0 else ["a", "the quick brown fox"]
    budget = 4 if rank == 0 else 40  # rank 0 finishes long before rank 1
    enc = tok(prompts, return_tensors="pt", padding=True)
    results = {}
    # tau = 0.5 with the masks on every step: the default's plain steps follow each run's timing
    for name, kw in {"tau=0.5": dict(mars_threshold=0.5, mars_plain_steps=False),
                     "verify": dict(mars_verify=True, mars_threshold=0.0), "tau=1": dict(mars_threshold=1.0)}.items():
        with torch.no_grad():
            sharded = model.generate(**enc, max_new_tokens=budget, do_sample=False, eos_token_id=[], **kw)
            alone = reference.generate(**enc, max_new_tokens=budget, do_sample=False, eos_token_id=[], **kw)
        results[name] = {"sharded": sharded.tolist(), "alone": alone.tolist()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
