"""Experiment: MARS mask-token drafting as a vLLM `custom_class` speculative proposer (vLLM's experimental
"Custom Proposer Backend"). vLLM hands a proposer token ids only — not the target's forward, KV cache or hidden
states — so this drafter keeps its own transformers copy of the checkpoint and runs one extra forward per step
over the context + k-1 mask tokens: draft 1 is the prediction at the last real token, draft j the prediction at
mask j-1. It is not MARS's single forward (masks appended to the verify pass); it shows what vLLM allows today.

    PYTHONPATH=benchmarks/engines python -m vllm.entrypoints.openai.api_server --model CKPT --dtype float32 \
        --speculative-config '{"method": "custom_class", "model": "vllm_mars_proposer.MarsProposer",
                               "num_speculative_tokens": 4}'
"""

import json
import os

import torch
from transformers import AutoModelForCausalLM


class MarsProposer:
    def __init__(self, vllm_config):
        path = vllm_config.model_config.model
        self.k = vllm_config.speculative_config.num_speculative_tokens
        with open(os.path.join(path, "config.json")) as f:
            self.mask_id = json.load(f)["mars"]["mask_token_id"]
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.max_len = vllm_config.model_config.max_model_len

    def load_model(self, *args, **kwargs):
        pass

    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        out = [[] for _ in sampled_token_ids]
        rows = [i for i, s in enumerate(sampled_token_ids) if len(s) and num_tokens_no_spec[i] + self.k < self.max_len]
        if not rows:
            return out
        seqs = [list(token_ids_cpu[i, :num_tokens_no_spec[i]]) + [self.mask_id] * (self.k - 1) for i in rows]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        att = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):  # left-padded
            ids[r, width - len(s):] = torch.tensor(s)
            att[r, width - len(s):] = 1
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -self.k:, :]
        logits[..., self.mask_id] = float("-inf")
        drafts = logits.argmax(-1).tolist()
        for r, i in enumerate(rows):
            out[i] = drafts[r]
        return out
