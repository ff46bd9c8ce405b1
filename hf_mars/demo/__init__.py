"""The embedded default and the benchmarks: scaffolding around the library, not part of it.

- `tiny`: a character-level tokenizer and tiny Qwen2 models built locally (tests, demo, CI; no network);
- `data`: the bundled, exactly checkable instruction tasks with a held-out split;
- `pipeline`: ``hf-mars demo`` (MARS fine-tune, AR-SFT baseline, accuracy and speed report, Hub-ready checkpoint),
  in steps: `training`, `evaluate`, `stats`, `outputs`;
- `bench`: ``hf-mars bench`` (MARS decoding against plain ``generate`` on any checkpoint), with `prompts` and
  `timing` (the one timing harness, which the demo uses too);
- `report`: `BenchmarkReport`, both commands' JSON read as one typed report, and the model card's table.

The library itself (``hf_mars.trainer``, ``masking``, ``tokens``, ``generation``, ``hub``) imports none of these,
except that `hf_mars.model_card` asks `report` for the measured table when a card is given ``benchmark=``: the
layouts are written here, so they are read here.
"""
