"""How often lossless verify mode differs from greedy in bf16 / fp16 on CPU, per architecture.

    python benchmarks/half_precision.py

Verify mode is exact in float32 (the tests compare token for token). In half precision a step that forwards
several tokens rounds differently from a one-token step, so the AR prediction at a verified position can flip
where two tokens are nearly tied — as transformers documents for assisted generation. This counts the rows
(tiny random models of tests/architectures.py, 16 prompts, left-padded batches of 4, 32 new tokens) whose
verify output equals plain greedy in the same dtype; tau = 1 (one-token steps) is reported alongside.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from architectures import ARCHITECTURES, build  # noqa: E402

from hf_mars import enable_mars  # noqa: E402
from hf_mars.bench.tasks import generate_examples  # noqa: E402
from hf_mars.testing_utils import build_char_tokenizer  # noqa: E402
from hf_mars.training.tokens import set_mars_metadata  # noqa: E402


def main():
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    prompts = [ex["messages"][0]["content"] for ex in generate_examples(16, seed=0, split="eval")]
    print("| architecture | dtype | τ = 1 rows = greedy | verify rows = greedy |")
    print("|---|---|---|---|")
    for arch in ARCHITECTURES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            model = enable_mars(build(arch, tok)).to(dtype)
            set_mars_metadata(model.config, block_size=4, trained_steps=1)
            same_t1 = same_v = total = 0
            for i in range(0, len(prompts), 4):
                enc = tok(prompts[i:i + 4], return_tensors="pt", padding=True)
                kw = dict(max_new_tokens=32, do_sample=False)
                plain = model.generate(**enc, **kw)
                t1 = model.generate(**enc, mars_threshold=1.0, **kw)
                ver = model.generate(**enc, mars_verify=True, mars_threshold=0.0, **kw)
                same_t1 += sum(torch.equal(a, b) for a, b in zip(plain, t1))
                same_v += sum(torch.equal(a, b) for a, b in zip(plain, ver))
                total += len(plain)
            print(f"| {arch} | {str(dtype)[6:]} | {same_t1}/{total} | {same_v}/{total} |", flush=True)


if __name__ == "__main__":
    main()
