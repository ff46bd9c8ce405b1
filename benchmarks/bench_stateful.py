"""What the exact paths for stateful logits processors / stopping criteria cost.

    python benchmarks/bench_stateful.py                      # a position-only tiny GPT-2 (drafts mostly right)
    python benchmarks/bench_stateful.py --model runs/demo/mars-checkpoint

For each client kind it times plain `generate` and MARS (threshold tau and verify) on the same prompts in the
same run, and prints tokens per forward and the wall-clock ratio to plain `generate` with the same client:

- none: no processor (the fast path);
- stateless: transformers' repetition penalty (known pure: applied to candidates directly, rows ragged);
- stateful (copyable): a Python processor with state (speculation on deep copies, replayed on the real one);
- stateful (native): xgrammar's JSON-schema processor, which cannot be copied (threshold mode: one token per
  forward; verify: called on accepted positions only);
- stateful criterion: an lm-eval-style sticky stop criterion (called behind the rows on emitted positions; rows
  are not held in lockstep).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = ["hello world", "a", "the quick brown fox", "xy", "lorem ipsum", "123", "abc def", "zz top"]


class CountingProcessor(LogitsProcessor):
    """Stateful (it counts its calls) and copyable."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


class StickyCriterion(StoppingCriteria):
    def __init__(self, token):
        self.token, self.done = token, None

    def __call__(self, input_ids, scores, **kwargs):
        hit = input_ids[:, -1] == self.token
        self.done = hit if self.done is None else self.done | hit
        return self.done.clone()


def _load(path):
    from hf_mars import enable_mars
    from hf_mars.testing_utils import build_char_tokenizer

    if path is None:
        from test_stateful_clients import position_only_model

        tok = build_char_tokenizer()
        return position_only_model(tok), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return enable_mars(AutoModelForCausalLM.from_pretrained(path).eval()), tok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clients", default=None, help="Comma-separated client names to run (default: all).")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = _load(args.model)
    V = model.get_output_embeddings().weight.shape[0]
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)).compile_builtin_json_grammar()
    stop_token = tok.convert_tokens_to_ids("X")
    clients = {
        "none": lambda: {},
        "stateless": lambda: {"logits_processor": LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1)])},
        "stateful (copyable)": lambda: {"logits_processor": LogitsProcessorList([CountingProcessor()])},
        "stateful (native, xgrammar)": lambda: {"logits_processor": LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)])},
        "stateful criterion": lambda: {"stopping_criteria": StoppingCriteriaList([StickyCriterion(stop_token)])},
    }
    if args.clients:
        clients = {name: clients[name] for name in args.clients.split(",")}
    modes = {"plain": {}, "tau=0.5": {"mars_threshold": 0.5}, "tau=0": {"mars_threshold": 0.0},
             "verify": {"mars_verify": True, "mars_threshold": 0.0}}
    rows = []
    for batch in (1, 4):
        enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True)
        for client, make in clients.items():
            res = {}
            for mode, kw in modes.items():
                best, tpf = float("inf"), None
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                         return_dict_in_generate=True, **kw, **make())
                    best = min(best, time.perf_counter() - t0)
                    if mode != "plain":
                        tpf = float(out.mars_emitted_tokens.sum() / out.mars_forward_passes.sum())
                res[mode] = (best, tpf)
            for mode in ("tau=0.5", "tau=0", "verify"):
                rows.append({"batch": batch, "client": client, "mode": mode, "tokens_per_forward": round(res[mode][1], 2),
                             "speedup_vs_plain": round(res["plain"][0] / res[mode][0], 2)})
    print("| batch | client | mode | tokens/forward | speed-up vs plain generate (same client) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['client']} | {r['mode']} | {r['tokens_per_forward']:.2f} | {r['speedup_vs_plain']:.2f}× |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
