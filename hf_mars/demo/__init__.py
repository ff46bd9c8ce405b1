"""The embedded default and the benchmarks: scaffolding around the library, not part of it.

- `tiny`: a character-level tokenizer and tiny Qwen2 models built locally (tests, demo, CI; no network);
- `data`: the bundled, exactly checkable instruction tasks with a held-out split;
- `pipeline`: ``hf-mars demo`` (MARS fine-tune, AR-SFT baseline, accuracy and speed report, Hub-ready checkpoint);
- `bench`: ``hf-mars bench`` (MARS decoding against plain ``generate`` on any checkpoint).

The library itself (``hf_mars.trainer``, ``masking``, ``tokens``, ``generation``, ``hub``) imports none of these.
"""
