"""`hf-mars demo`: the embedded default, end to end. Scaffolding around the library, not part of it.

- `pipeline`: ``hf-mars demo`` (MARS fine-tune, AR-SFT baseline, accuracy and speed report, Hub-ready checkpoint),
  in steps: `training`, `evaluate`, `stats`, `outputs`; `real` and `real_text` the path for a pretrained base;
- `short_answers`: ``hf-mars bench --short-answers``' comparison against MARS without a KV cache.

The demo builds on `hf_mars.bench` (the bundled tasks, the timing harness, the report) and on the library; nothing
outside this package imports it (`tests/test_layout.py` checks). The modules that moved out of it (`bench`,
`bench_format`, `prompts`, `timing`, `report`, `data` to `hf_mars.bench`, `tiny` to `hf_mars.testing_utils`) keep
their old names here as aliases of the moved modules.
"""
